"""The suite's warm launcher (tests/_warm.py) stands in for torchrun in the multi-rank training tests: its ranks
must see what torchrun's workers see, meet in one gloo process group, and end as torchrun's do (the first rank
that fails takes the others down, its exit status the launch's; a SIGKILLed rank reads -9)."""

from __future__ import annotations

import os
import textwrap

import _warm

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed as dist

    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
    print("env", *(os.environ[k] for k in keys), flush=True)
    if mode == "sum":
        dist.init_process_group("gloo")
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        print("sum", rank, int(t.item()), flush=True)
        dist.destroy_process_group()
    elif mode == "fail" and rank == 1:
        sys.exit(3)
    elif mode == "kill" and rank == 0:
        os.kill(os.getpid(), 9)
    else:
        time.sleep(0 if mode == "sum" else 120)
    open(os.path.join(out, f"done-{rank}"), "w").close()
""")


def _launch(tmp_path, mode: str, ranks: int):
    script = tmp_path / "rank_script.py"
    script.write_text(SCRIPT)
    return _warm.run(str(script), str(tmp_path), mode, cwd=str(tmp_path), env=dict(os.environ), timeout=100,
                     ranks=ranks)


def test_ranks_see_torchrun_s_variables_and_meet_in_one_process_group(tmp_path):
    proc = _launch(tmp_path, "sum", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    envs = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("env"))
    assert [e[:5] for e in envs] == [[str(r), str(r), "3", "3", "0"] for r in range(3)]
    assert len({e[5] for e in envs}) == 1  # one run id
    sums = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("sum"))
    assert sums == [[str(r), "6"] for r in range(3)]
    assert sorted(os.listdir(tmp_path)) == ["done-0", "done-1", "done-2", "rank_script.py"]


def test_the_first_failing_rank_takes_the_others_down_with_its_exit_status(tmp_path):
    failed = _launch(tmp_path, "fail", 2)
    assert failed.returncode == 3 and not list(tmp_path.glob("done-*"))  # rank 0 was sleeping, not finished
    killed = _launch(tmp_path, "kill", 2)
    assert killed.returncode == -9 and not list(tmp_path.glob("done-*"))
