"""One rank of tests/test_registration_collision.py (started as torchrun would, RANK / WORLD_SIZE / MASTER_* in
the environment): opens a StreamingDataset through ``create_registered`` while, on rank 0, another owner creates
the ``_locals`` segment streaming's leader is about to create (as a racing job that does not take our lock
would, after every rank scanned). Writes ``rank<r>.json``: the prefix, the sample count and first token, or the
error.

    python _registration_race.py TMP
"""

from __future__ import annotations

import json
import os
import sys
from multiprocessing.shared_memory import SharedMemory as Builtin
from pathlib import Path


def main(tmp: str) -> int:
    import streaming.base.shared.prefix as prefix
    import torch.distributed as dist
    from streaming import StreamingDataset

    from grape_stream.streaming_compat.registration import create_registered
    from grape_stream.streaming_compat.shm import release_streaming_dataset

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    taken: list[Builtin] = []
    real = prefix.SharedMemory

    def racing(name: str, create: bool | None = None, size: int = 0, *args: object, **kwargs: object) -> object:
        if create is True and name.endswith("_locals") and not taken:
            taken.append(Builtin(name, create=True, size=64))  # the other job wins the race for this name
            Path(tmp, "taken.json").write_text(json.dumps(name))
        return real(name, create, size, *args, **kwargs)

    if rank == 0:
        prefix.SharedMemory = racing
    out: dict = {}
    try:
        ds = create_registered(lambda: StreamingDataset(local=os.path.join(tmp, "mine"), batch_size=1,
                                                        shuffle=False), enabled=int(os.environ["LOCAL_RANK"]) == 0)
        out = {"prefix": ds._shm_prefix_int, "samples": ds.num_samples, "first": int(ds[0]["tokens"][0])}
        dist.barrier()
        release_streaming_dataset(ds)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        prefix.SharedMemory = real
        for shm in taken:
            shm.close()
            shm.unlink()
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
