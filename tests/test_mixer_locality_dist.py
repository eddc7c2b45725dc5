"""Each node reads its share, with real processes: 2 "nodes" x 2 ranks (torch.distributed gloo, separate local
caches, each node signing its S3 requests with its own access key) read the mixer's global stream from S3
(moto_server behind the fault proxy, which counts the bytes each key downloads). Every node downloads about
its canonical node's share of every domain (its spans' shards plus at most one shard it shares with its
neighbour), not the shards of the whole stream; the job is SIGKILLed and resumes on 1 node x 2 ranks with the
checkpoint's canonical node count, continuing exactly the same global batches as an uninterrupted 1-rank run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from _mds_fixtures import identity, write_domains
from _parallel import free_port
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from test_mixer_elastic_dist import _kill_when, _phase_rows
from test_mixer_s3 import upload

HERE = Path(__file__).resolve().parent
SIZES = [96, 96, 96]  # 12 shards of 8 samples each; the run reads about 2/3 of an epoch of each
SPC = 8
G = 8  # 2 nodes x 2 ranks x 2 samples
NODES = 2
LAG = 3
N = 24
ALPHAS = np.random.default_rng(3).dirichlet(np.full(len(SIZES), 8.0), size=2).tolist()
CHANGES = {6: ALPHAS[0], 13: ALPHAS[1]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mdsloc"), SIZES, samples_per_shard=SPC)


def _reference(dirs) -> list[list]:
    """The uninterrupted run of the 2-canonical-node stream on one rank, whole global batches: rows per batch."""
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)], batch_size=G,
                                seed=5, lag=LAG, canonical_nodes=NODES) as m:
        out = []
        for batch in m.dataloader():
            out.append([[*identity({"tokens": t}), int(e), int(v)] for t, e, v in
                        zip(np.asarray(batch["tokens"]), batch["epoch"].tolist(), batch["weights_version"].tolist())])
            if m.consumed_batches in CHANGES:
                m.set_weights(CHANGES[m.consumed_batches])
            if m.consumed_batches == N:
                return out
    raise AssertionError("the reference ended early")


def _own_shm_works() -> bool:
    """Whether this machine lets a process tree get its own /dev/shm (a private mount namespace, as root)."""
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs tmpfs /dev/shm"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_NODE_TMPS: list[str] = []


@pytest.fixture(autouse=True)
def _remove_node_tmps():
    yield
    while _NODE_TMPS:
        shutil.rmtree(_NODE_TMPS.pop(), ignore_errors=True)


def _launch(cfg: dict, world: int, local: int, tmp: Path, name: str) -> list[subprocess.Popen]:
    """``world`` ranks in nodes of ``local`` (torchrun's variables), one process tree a node with its own
    /dev/shm and temp folder, as separate machines have (streaming registers its shared memory per machine:
    two nodes' leaders on one /dev/shm would pick the same names); node n signs with access key ``node<n>``."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    port = free_port()
    procs = []
    for node in range(world // local):
        # a short temp folder: multiprocessing's AF_UNIX sockets live there, and a socket path may hold 107 bytes
        # (under xdist tmp_path alone is ~70)
        node_tmp = tempfile.mkdtemp(prefix=f"gs{name}{node}-", dir="/tmp")
        _NODE_TMPS.append(node_tmp)
        ranks = []
        for r in range(node * local, (node + 1) * local):
            env = {"TMPDIR": node_tmp, "RANK": r, "WORLD_SIZE": world, "LOCAL_RANK": r % local,
                   "LOCAL_WORLD_SIZE": local, "GROUP_RANK": node, "AWS_ACCESS_KEY_ID": f"node{node}",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": 1,
                   "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
            assigns = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items())
            # stderr to a file, not a pipe: a chatty rank never blocks on it
            ranks.append(f"env {assigns} {shlex.quote(sys.executable)} {shlex.quote(str(HERE / '_elastic_run.py'))} "
                         f"{shlex.quote(str(path))} 2>{shlex.quote(str(tmp / f'{name}.rank{r}.err'))} &")
        script = "mount -t tmpfs tmpfs /dev/shm || exit 3\n" + "\n".join(ranks) + "\nwait\n"
        procs.append(subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    return procs


def _errors(tmp: Path, name: str) -> str:
    return "\n".join(p.read_text()[-1500:] for p in sorted(tmp.glob(f"{name}.rank*.err")))


def _shard_bytes(d: str) -> list[int]:
    return [p.stat().st_size for p in sorted(Path(d).glob("shard.*.mds"))]


@pytest.mark.timeout(600)
def test_two_nodes_download_their_share_then_resume_on_one_node(data, tmp_path, fault_proxy, s3_bucket):
    if not _own_shm_works():
        pytest.skip("two nodes on one machine need a private /dev/shm each (unshare -m, as root)")
    reference = _reference(data)
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"loc/d{k}") for k, d in enumerate(data)]
    fault_proxy.set_faults(error_rate=0.05, latency=0.001)
    fault_proxy.stats.bytes_by_key.clear()
    logs = [tmp_path / "log0", tmp_path / "log1"]
    for d in logs:
        d.mkdir()
    base = {"seed": 5, "global_batch_size": G, "lag": LAG, "every": 4, "remotes": remotes, "predownload": 4,
            "changes": {str(k): v for k, v in CHANGES.items()}, "state": str(tmp_path / "state.json")}
    node_caches = [[str(tmp_path / f"node{n}" / f"d{k}") for k in range(len(SIZES))] for n in range(NODES)]
    # 2 nodes x 2 ranks, 1 worker each, canonical_nodes left to its default (the 2 physical nodes): killed
    procs = _launch({**base, "node_caches": node_caches, "workers": 1, "until": N, "hold_after": 17,
                     "log": str(logs[0])}, 4, 2, tmp_path, "a")
    try:
        _kill_when(procs, logs[0], 17)
    except (AssertionError, AttributeError):  # no progress, or a rank ended early (its stderr is a file)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        raise AssertionError(_errors(tmp_path, "a")) from None
    first = json.loads((tmp_path / "state.json").read_text())
    assert first["batch"] == 16 and first["canonical_nodes"] == NODES and len(first["node_positions"]) == NODES
    # What each node downloaded (counted at the proxy, by access key): its spans' shards of each domain plus
    # at most one shard it shares with the other node, and the index; not the shards of the whole stream.
    shard_bytes = [_shard_bytes(d) for d in data]
    index = sum(os.path.getsize(Path(d) / "index.json") for d in data)
    share = sum(sum(b) / NODES + max(b) for b in shard_bytes)
    total = sum(sum(b) for b in shard_bytes)
    got = [fault_proxy.stats.bytes_by_key[f"node{n}"] for n in range(NODES)]
    assert all(0 < g <= share + index for g in got), (got, share, total)
    assert sum(got) <= total + sum(max(b) for b in shard_bytes) + NODES * index  # the nodes' shares barely overlap
    for n in range(NODES):  # and each node's cache holds only its share
        cached = sum(p.stat().st_size for k in range(len(SIZES)) for p in Path(node_caches[n][k]).glob("shard.*.mds"))
        assert cached <= share
    # 1 node x 2 ranks resumes from the same S3 with the checkpoint's 2 canonical nodes, and finishes
    procs = _launch({**base, "caches": node_caches[0], "workers": 1, "until": N, "log": str(logs[1]),
                     "resume": str(tmp_path / "state.json")}, 2, 2, tmp_path, "b")
    for p in procs:  # the node's shell: 0 when every rank exited 0 (wait returns the last one's status)
        assert p.wait(timeout=300) == 0, _errors(tmp_path, "b")
    assert "Error" not in _errors(tmp_path, "b")
    covered = []
    for log, world, lo, hi in ((logs[0], 4, 0, first["batch"]), (logs[1], 2, first["batch"], N)):
        rows, per = _phase_rows(log, world), G // world
        for i, by_rank in rows.items():  # everything any rank read is its slice of the uninterrupted batch
            for r, mine in by_rank.items():
                assert mine == reference[i][r * per:(r + 1) * per], (world, i, r)
        covered += [[row for r in range(world) for row in rows[i][r]] for i in range(lo, hi)]
    assert covered == reference  # nothing repeated, nothing skipped
    assert {row[3] for b in covered for row in b} == {0, 1, 2}  # the weight changes carried over
