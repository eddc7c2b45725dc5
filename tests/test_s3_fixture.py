import boto3


def test_s3_roundtrip(s3_server, s3_bucket):
    client = boto3.client("s3", endpoint_url=s3_server)
    client.put_object(Bucket=s3_bucket, Key="a/b.txt", Body=b"hello")
    assert client.get_object(Bucket=s3_bucket, Key="a/b.txt")["Body"].read() == b"hello"
