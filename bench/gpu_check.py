"""What only a GPU can tell: the fused alignment engine on CUDA (float64 exactness, float32 / bf16 error), its
overhead and peak memory at a 125M model, and NCCL + FSDP2 on the device.

Nothing in CI has a GPU, so this is the one script to run when a machine with one is lent (it needs only
torch, numpy and this checkout: no Composer, no mosaicml-streaming, no data):

    PYTHONPATH=$PWD python bench/gpu_check.py [--quick] [--out bench/results/gpu_check.json]

Sections (each reports its own error in one line instead of stopping the script):

* ``exact``: our GPT (and an HF Llama when transformers imports) in float64 on CUDA: ``group_gram`` against the
  definition (one ``autograd.grad`` per group, inner products) on the same device, and against the CPU.
* ``precision``: the same probe with float32 weights (TF32 off, then on) and under bf16 autocast, each against
  the float64 definition of the same weights: the error a user of mixed precision sees.
* ``instep``: in-step alignments (``alignments: steps``) on a CUDA backward against the definition.
* ``m125``: GPT-2-small shape (12 x 768, vocab 50,257, 1,024 tokens), bf16 autocast, fused AdamW: a training
  step's time and peak memory, then one GRAPE update's probe (K domain + N task groups of 8 samples) at K=7, N=6
  and K=20, N=6: its time, its extra peak memory over the training step's, and the wall overhead at an update
  every 100 steps.
* ``fsdp``: a one-rank NCCL process group, our GPT under FSDP2 ``fully_shard`` (float64 and bf16 mixed
  precision): ``group_gram`` of the sharded model against the unsharded one.
* ``m125_fsdp2``: the 125M model under FSDP2 with bf16 parameters (one-rank NCCL): a step's time and peak, and
  the probe's (K=7, N=6) at 4 and 8 samples a group through the sharded engine.

Each section runs in a process of its own, so one section's memory (or a caught out-of-memory) never shows in
another's peak.

Prints a table and writes JSON (default bench/results/gpu_check.json).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch
from common import parser, write_json  # (it puts the repository on sys.path)

from grape_stream.grape.gram.group_gram import group_gram  # noqa: E402
from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss  # noqa: E402

# GPU_CHECK_DEVICE=cpu: a smoke run of the script itself on a machine without a GPU (numbers meaningless).
DEV = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda:0"))
# GPT-2 small's shape (124M parameters with the tied head).
M125 = dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, d_ff=3072)


# ------------------------------------------------------------------------------------------- helpers
def truth_gram(model: torch.nn.Module, groups: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, independent of the engine: one autograd.grad per group of its mean loss, flattened."""
    params = [p for p in model.parameters() if p.requires_grad]
    vecs, losses = [], []
    for batch in groups:
        per = per_sample_lm_loss(model, batch)
        grads = torch.autograd.grad(per.mean(), params, allow_unused=True)
        vecs.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                               for g, p in zip(grads, params)]))
        losses.append(per.detach().double().mean())
    v = torch.stack(vecs)
    return (v @ v.t()).cpu(), torch.stack(losses).cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def tiny_gpt(dtype: torch.dtype, seed: int = 0, **kw: Any) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=300, seq_len=32, n_layer=2, n_head=2, d_model=64, d_ff=128)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).to(DEV, dtype).eval()


def token_groups(count: int, per_group: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, vocab, (per_group, seq + 1), generator=gen).to(DEV)}
            for _ in range(count)]


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def peak_reset() -> None:
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    return torch.cuda.max_memory_allocated() if DEV.type == "cuda" else 0


def gib(n: int) -> float:
    return n / 2**30


# ------------------------------------------------------------------------------------------- sections
def section_exact() -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = tiny_gpt(torch.float64)
    groups = token_groups(5, 4, 32, 300)
    gram, losses = group_gram(model, per_sample_lm_loss, groups)
    t_gram, t_losses = truth_gram(model, groups)
    out["gpt_float64_vs_definition"] = rel_err(gram, t_gram)
    out["gpt_float64_losses_vs_definition"] = rel_err(losses, t_losses)
    cpu_gram, _ = group_gram(copy.deepcopy(model).cpu(), per_sample_lm_loss,
                             [{k: v.cpu() for k, v in g.items()} for g in groups])
    out["gpt_float64_cuda_vs_cpu"] = rel_err(gram, cpu_gram)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from grape_stream.models import causal_lm_kwargs, per_sample_causal_lm_loss

        torch.manual_seed(0)
        llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64)).to(DEV, torch.float64).eval()

        def llama_loss(m: torch.nn.Module, batch: dict) -> torch.Tensor:
            ids = batch["tokens"][:, :-1]
            return per_sample_causal_lm_loss(m, causal_lm_kwargs(m, ids), batch)

        lg, _ = group_gram(llama, llama_loss, groups)
        params = [p for p in llama.parameters() if p.requires_grad]
        vecs = []
        for batch in groups:
            grads = torch.autograd.grad(llama_loss(llama, batch).mean(), params, allow_unused=True)
            vecs.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                   for g, p in zip(grads, params)]))
        v = torch.stack(vecs).double()
        out["hf_llama_float64_vs_definition"] = rel_err(lg, (v @ v.t()).cpu())
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["hf_llama_error"] = one_line(e)
    return out


def section_precision() -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref = tiny_gpt(torch.float64, seed=1)
    groups = token_groups(5, 8, 32, 300, seed=1)
    t_gram, _ = truth_gram(ref, groups)
    m32 = copy.deepcopy(ref).float()
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        g32, _ = group_gram(m32, per_sample_lm_loss, groups)
        out[f"float32{'_tf32' if tf32 else ''}_vs_float64"] = rel_err(g32, t_gram)
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        gbf, _ = group_gram(m32, per_sample_lm_loss, groups)
    out["bf16_autocast_vs_float64"] = rel_err(gbf, t_gram)
    mbf = copy.deepcopy(ref).bfloat16()
    gbp, _ = group_gram(mbf, per_sample_lm_loss, groups)
    t_bf, _ = truth_gram(copy.deepcopy(mbf).double(), groups)
    out["bf16_params_vs_float64_of_same_weights"] = rel_err(gbp, t_bf)
    return out


def section_instep() -> dict[str, Any]:
    from grape_stream.grape.gram.instep import StepAlignments

    model = tiny_gpt(torch.float64, seed=2)
    k = 3
    gen = torch.Generator().manual_seed(2)
    batch = {"tokens": torch.randint(0, 300, (12, 33), generator=gen).to(DEV),
             "domain": torch.tensor([0, 1, 2] * 4, device=DEV)}
    params = [p for p in model.parameters() if p.requires_grad]
    dirs = [{p: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(DEV) for p in params} for _ in range(2)]
    sa = StepAlignments(model, per_sample_lm_loss, k)
    sa.set_directions(dirs)
    with sa.observe(batch):
        per_sample_lm_loss(model, batch).mean().backward()
    got = sa.alignments()
    truth = torch.zeros(k, 2, dtype=torch.float64)
    for d in range(k):
        mask = (batch["domain"] == d).double()
        loss = (per_sample_lm_loss(model, batch) * mask).sum() / mask.sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for j, u in enumerate(dirs):
            truth[d, j] = sum(float((g * u[p]).sum()) for g, p in zip(grads, params) if g is not None)
    return {"instep_float64_vs_definition": rel_err(got, truth)}


def section_m125(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.backends.cuda.matmul.allow_tf32 = True
    seq, batch_size, per_group = (256, 8, 4) if quick else (1024, 16, 8)
    torch.manual_seed(0)
    vocab = int(M125["vocab_size"])
    model = GPT(GPTConfig(seq_len=seq, **M125)).to(DEV)
    out["params"] = model.num_params()
    t_step, peak_step = _train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                                     batch_size, seq, vocab, autocast=True, repeats=10)
    out.update(seq=seq, batch=batch_size, probe_samples_per_group=per_group, seconds_per_step=t_step,
               peak_step_gib=gib(peak_step))
    for k, n in ((7, 6), (20, 6)):
        groups = token_groups(k + n, per_group, seq, vocab, seed=k)
        samples = (k + n) * per_group
        # Micro-batches of the training step's size, then the default (one fused pass over all the probe's samples).
        for mbs in (batch_size, None):
            key = f"k{k}_n{n}" + ("" if mbs is None else f"_micro{mbs}")
            try:
                out[key] = _probe_cost(model, groups, mbs, t_step, peak_step, samples, batch_size)
            except torch.OutOfMemoryError as e:
                out[key] = {"error": one_line(e)}
            gc.collect()  # an OOM's traceback holds the failed pass's tensors in reference cycles
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
    return out


def _train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batch_size: int, seq: int, vocab: int, *,
                 autocast: bool, repeats: int) -> tuple[float, int]:
    """A training step's median time and peak memory (after 3 warm-up steps), on random tokens."""
    gen = torch.Generator().manual_seed(0)
    train_batch = {"tokens": torch.randint(0, vocab, (batch_size, seq + 1), generator=gen).to(DEV)}

    def step() -> None:
        with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=autocast):
            loss = per_sample_lm_loss(model, train_batch).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    peak_reset()
    t_step, _ = timed(step, repeats)
    return t_step, peak()


def _probe_cost(model: torch.nn.Module, groups: list[dict], mbs: Any, t_step: float, peak_step: int,
                samples: int, batch_size: int, autocast: bool = True) -> dict[str, Any]:
    def probe() -> Any:
        with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=autocast):
            return group_gram(model, per_sample_lm_loss, groups, return_info=True, micro_batch_size=mbs)

    probe()  # layouts and caches, as the first update of a run
    peak_reset()
    t_probe, (gram, _, info) = timed(probe, 3)
    peak_probe = peak()
    return {
        "seconds_per_update": t_probe,
        "update_in_steps": t_probe / t_step,
        "wall_overhead_every_100": t_probe / (100 * t_step),
        "peak_probe_gib": gib(peak_probe),
        "extra_peak_memory": max(0.0, (peak_probe - peak_step) / max(peak_step, 1)),
        "extra_gradient_computations_per_step": samples / (100 * batch_size),
        "gram_finite": bool(torch.isfinite(gram).all()),
        "fallback_params": len(getattr(info, "fallback_params", []) or []),
    }


@contextlib.contextmanager
def one_rank_group() -> Iterator[str]:
    """A one-rank process group on the device's own backend (NCCL on CUDA)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = "nccl" if DEV.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, **({"device_id": DEV} if DEV.type == "cuda" else {}))
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def section_fsdp() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out: dict[str, Any] = {"nccl_available": dist.is_nccl_available()}
    with one_rank_group() as backend:
        t = torch.ones(4, device=DEV)
        dist.all_reduce(t)
        out[f"{backend}_all_reduce_ok"] = bool(t.sum().item() == 4)
        groups = token_groups(5, 4, 32, 300, seed=3)
        for label, dtype, mp in (("float64", torch.float64, None),
                                 ("bf16_mixed", torch.float32,
                                  MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
            try:
                ref = tiny_gpt(dtype, seed=3)
                want, _ = group_gram(ref, per_sample_lm_loss, groups)
                sharded = copy.deepcopy(ref)
                kw = {} if mp is None else {"mp_policy": mp}
                for block in sharded.blocks:
                    fully_shard(block, **kw)
                fully_shard(sharded, **kw)
                got, _ = group_gram(sharded, per_sample_lm_loss, groups)
                out[f"fsdp2_{label}_vs_unsharded"] = rel_err(got, want)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                out[f"fsdp2_{label}_error"] = one_line(e)
    return out


def section_m125_fsdp2() -> dict[str, Any]:
    with one_rank_group():
        return _m125_fsdp2()


def _m125_fsdp2() -> dict[str, Any]:
    """The 125M model under FSDP2 (each block a unit, bf16 parameters, float32 reductions) on the one-rank
    NCCL group: a training step, then GRAPE's probe (K=7, N=6) through the sharded engine."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    seq, batch_size = 1024, 16
    vocab = int(M125["vocab_size"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=seq, **M125)).to(DEV)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    t_step, peak_step = _train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch_size, seq, vocab,
                                     autocast=False, repeats=5)
    out: dict[str, Any] = {"seconds_per_step": t_step, "peak_step_gib": gib(peak_step)}
    for per_group in (4, 8):
        groups = token_groups(13, per_group, seq, vocab, seed=per_group)
        try:
            out[f"k7_n6_b{per_group}"] = _probe_cost(model, groups, None, t_step, peak_step, 13 * per_group,
                                                     batch_size, autocast=False)
        except torch.OutOfMemoryError as e:
            out[f"k7_n6_b{per_group}"] = {"error": one_line(e)}
        gc.collect()
        torch.cuda.empty_cache() if DEV.type == "cuda" else None
    return out


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0], "gpu_check", quick="a smaller m125 section (256 tokens, batch 8)",
                out_help="JSON output path")
    ap.add_argument("--sections", default="exact,precision,instep,m125,fsdp,m125_fsdp2",
                    help="comma-separated sections to run (default: all), each in its own process")
    ap.add_argument("--section-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; this script is for a machine with a GPU")
        return 2
    result: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if DEV.type == "cuda" else DEV.type,
        "bf16_supported": DEV.type == "cuda" and torch.cuda.is_bf16_supported(),
        "python": platform.python_version(), "sections": {},
    }
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "exact": section_exact, "precision": section_precision, "instep": section_instep,
        "m125": lambda: section_m125(args.quick), "fsdp": section_fsdp, "m125_fsdp2": section_m125_fsdp2,
    }
    if args.section_only:  # the child: one section, its dict to --out
        t0 = time.perf_counter()
        try:
            sec = runners[args.section_only]()
        except Exception as e:  # noqa: BLE001 - one section's failure is a result, the others still run
            sec = {"error": one_line(e), "traceback": traceback.format_exc()[-2000:]}
        sec["seconds"] = round(time.perf_counter() - t0, 2)
        with open(args.out, "w") as f:
            json.dump(sec, f, default=str)
        return 0
    for name in args.sections.split(","):
        # Each section in a fresh process: no section's allocations (or a caught OOM's) colour another's peak.
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), "--section-only", name, "--out", tmp.name]
            proc = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True)
            try:
                with open(tmp.name) as f:
                    result["sections"][name] = json.load(f)
            except (OSError, ValueError):
                result["sections"][name] = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
        print(f"[{name}] {json.dumps(result['sections'][name], default=str)[:1500]}", flush=True)
    print(f"\ngpu_check on {result['device']} (torch {result['torch']}, CUDA {result['cuda']})")
    print(f"{'section':10} {'measure':48} value")
    for name, sec in result["sections"].items():
        for key, value in sec.items():
            if key == "traceback":
                continue
            if isinstance(value, dict):
                for k2, v2 in value.items():
                    print(f"{name:10} {key + '.' + k2:48} {v2:.4g}" if isinstance(v2, float)
                          else f"{name:10} {key + '.' + k2:48} {v2}")
            else:
                print(f"{name:10} {key:48} {value:.4g}" if isinstance(value, float) else f"{name:10} {key:48} {value}")
    write_json(args.out, result, default=str)
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "gpu_check.json"), result, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
