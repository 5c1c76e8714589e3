"""Train strata's embedded default model: a small Qwen2-MoE on Python source (the standard library).

Run on one GPU (it was trained on an H200; see docs/model-card.md):

    PYTHONUNBUFFERED=1 python3 scripts/train_tiny_moe.py --out OUT --minutes 7 --seed 0

and convert the result like any other checkpoint:

    mkdir OUT/hf && tar -xf OUT/small.tar -C OUT/hf && cp OUT/*.safetensors OUT/hf/
    strata convert OUT/hf strata/data/default --experts q2_0 --dense f16

What it does, in order (all of it deterministic given --seed, except where noted):

1. **Corpus**: every `*.py` file under this interpreter's standard library
   (`sysconfig.get_paths()["stdlib"]`, its test suite too where installed, `site-packages`
   excluded), in sorted order of the relative path; files that are not UTF-8 or larger than
   MAX_SOURCE_BYTES (generated tables) are skipped. Where the standard library holds fewer
   than --min-corpus-chars characters (a distribution's python without its test suite), it
   is topped up with `*.py` files of the interpreter's site-packages, taken in order of
   sha256(relative path) (a spread over packages, not the alphabetically first ones).
   A file is held out when sha256("stdlib/" or "site-packages/" + relative path) % 1000 <
   HELDOUT_PERMILLE, so the split depends on the path alone.
2. **Tokenizer**: a byte-level BPE of --vocab tokens (one special token, `<|endoftext|>`,
   which also separates the files) trained by `tokenizers` on the training files.
3. **Model**: `transformers`' Qwen2MoeForCausalLM (a gated shared expert + routed experts,
   softmax -> top-k, q/k/v bias, tied embeddings) with the router's load-balancing loss.
4. **Training**: AdamW, bf16 autocast, linear warm-up then cosine decay, windows of --seq-len
   tokens at offsets drawn from a seeded generator. The number of steps is --steps when given;
   otherwise it is calibrated from the measured speed of the first steps so that the whole
   script ends inside --minutes, capped by --max-epochs (the calibrated count is printed and
   saved, and `--steps N` replays that run). Held-out loss is measured every --eval-every
   steps; the weights with the best held-out loss are the ones saved.
5. **Output** (sized for a device run that returns at most 8 files of <= 16 MiB): the
   checkpoint's safetensors shards (float16) directly in --out, and `small.tar` holding
   config.json, the safetensors index, tokenizer.json, tokenizer_config.json,
   generation_config.json, train_log.json (loss curve, tokens seen, timings) and heldout.txt
   (a ~24 KiB sample of held-out library code, shipped as strata/data/heldout.txt).

`--tiny` shrinks everything (a 2-layer model, a slice of the corpus, a few steps) to test the
script on a CPU in about a minute.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

# cuBLAS picks deterministic reduction orders only with a fixed workspace; set before CUDA starts
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402

EOT = "<|endoftext|>"
HELDOUT_PERMILLE = 50  # 5% of files, by path hash
HELDOUT_SAMPLE_BYTES = 24 * 1024  # strata/data/heldout.txt
HELDOUT_SAMPLE_FILE_BYTES = 6 * 1024  # at most this much of one file, so the sample spans several
EVAL_TOKENS = 128 * 1024  # held-out tokens scored at each evaluation
MAX_SOURCE_BYTES = 256 * 1024  # larger sources are generated tables (unicode data, docs as strings)
MIN_CORPUS_CHARS = 48_000_000  # below this the stdlib (no test suite) is topped up from site-packages
MAX_FILE_BYTES = 16 * 1024 * 1024  # device return limit per file
SHARD_SIZE = "14MB"  # safetensors shards stay under MAX_FILE_BYTES
CALIBRATION_STEPS = 12  # steps timed (after the first two) to size the run
SAFETY = 0.93  # fraction of the remaining time budget the calibrated steps may use
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
SMALL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "train_log.json", "heldout.txt")

MODEL = dict(  # the shipped architecture (~28 M parameters, ~4.6 M active per token)
    hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    num_experts=64, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
    intermediate_size=512,  # unused: every layer is an MoE layer
    max_position_embeddings=1024,
)
TINY_MODEL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    intermediate_size=128, max_position_embeddings=256,
)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------- corpus

class _Sources:
    """The UTF-8 `*.py` files under root of at most MAX_SOURCE_BYTES, read lazily in the order
    `order(relative path)` gives, as (prefix + relative posix path, text); counts skips."""

    def __init__(self, root: Path, prefix: str, order) -> None:
        rels = [p.relative_to(root).as_posix() for p in root.rglob("*.py")]
        self.rels = sorted((r for r in rels if not set(r.split("/")) & set(EXCLUDED_DIRS)), key=order)
        self.root, self.prefix, self.skipped = root, prefix, 0

    def __iter__(self):
        for rel in self.rels:
            p = self.root / rel
            try:
                if p.stat().st_size > MAX_SOURCE_BYTES:
                    raise ValueError("generated table")
                text = p.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError, ValueError):
                self.skipped += 1
                continue
            if text.strip():
                yield self.prefix + rel, text


def path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:4], "big")


def corpus_files(stdlib: Path, site: Path | None, min_chars: int) -> list[tuple[str, str]]:
    """The standard library's sources in path order; then, only if they hold fewer than
    `min_chars` characters, files of `site` (site-packages) in path-hash order until they do."""
    std = _Sources(stdlib, "stdlib/", order=lambda r: r)
    files = list(std)
    n_std, chars = len(files), sum(len(t) for _, t in files)
    log(f"corpus: {n_std} files, {chars / 1e6:.1f} M chars from {stdlib} ({std.skipped} skipped: not UTF-8, "
        f"unreadable or over {MAX_SOURCE_BYTES // 1024} KiB)")
    if site is not None and chars < min_chars and site.is_dir():
        for rel, text in _Sources(site, "site-packages/", order=lambda r: (path_hash(r), r)):
            if chars >= min_chars:
                break
            files.append((rel, text))
            chars += len(text)
        log(f"corpus: topped up with {len(files) - n_std} files of {site} (path-hash order) to {chars / 1e6:.1f} M chars")
    return files


def is_heldout(rel: str) -> bool:
    return path_hash(rel) % 1000 < HELDOUT_PERMILLE


def heldout_sample(files: list[tuple[str, str]]) -> str:
    """A few held-out library (non-test) files, each cut at a line end, ~HELDOUT_SAMPLE_BYTES."""
    pieces, total = [], 0
    for rel, text in files:
        if not rel.startswith("stdlib/") or "test" in rel.lower() or len(text) < 1024:
            continue
        cut = text[:HELDOUT_SAMPLE_FILE_BYTES]
        cut = cut[: cut.rfind("\n") + 1] if len(text) > HELDOUT_SAMPLE_FILE_BYTES else cut
        pieces.append(cut)
        total += len(cut.encode("utf-8"))
        if total >= HELDOUT_SAMPLE_BYTES:
            break
    return "\n".join(pieces)


# ------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """All texts' ids, each followed by <|endoftext|>, as one int32 stream."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


# ----------------------------------------------------------------------------------------- model

def build_model(args, vocab: int, eot: int):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    shape = TINY_MODEL if args.tiny else MODEL
    cfg = Qwen2MoeConfig(
        vocab_size=vocab, **shape, tie_word_embeddings=True, qkv_bias=True, norm_topk_prob=False,
        rms_norm_eps=1e-6, initializer_range=0.02, output_router_logits=True,
        router_aux_loss_coef=args.aux_coef, use_cache=False, bos_token_id=None, eos_token_id=eot,
        pad_token_id=None, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
    )
    torch.manual_seed(args.seed)
    model = Qwen2MoeForCausalLM(cfg)
    return model


def experts_implementation(model) -> str:
    return str(getattr(model.config, "_experts_implementation", "eager"))


def set_experts_implementation(model, name: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    else:  # older transformers: the config attribute is what the experts read
        model.config._experts_implementation = name


# -------------------------------------------------------------------------------------- training

def lr_at(step: int, total: int, args) -> float:
    warm = args.warmup  # fixed, so a calibrated run and its `--steps N` replay share the schedule
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    floor = args.lr * args.min_lr_frac
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Batches:
    """Windows of seq_len tokens at offsets from a seeded CPU generator (device-independent)."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch: int, seed: int, device) -> None:
        self.stream = torch.from_numpy(stream.astype(np.int64))
        self.seq_len, self.batch, self.device = seq_len, batch, device
        self.gen = torch.Generator().manual_seed(seed)
        self.idx = torch.arange(seq_len)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.stream) - self.seq_len, (self.batch,), generator=self.gen)
        x = self.stream[starts[:, None] + self.idx[None, :]]  # [B, S]
        return x.to(self.device, non_blocking=True)


def autocast(device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, device, batch: int) -> float:
    """Mean next-token cross-entropy (nats) over the held-out windows."""
    model.eval()
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].to(device)
        with autocast(device):
            logits = model(input_ids=x, output_router_logits=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1), reduction="sum")
        total += loss
        count += x[:, 1:].numel()
    model.train()
    return float(total) / count


def train_step(model, opt, x, lr: float, args, device):
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(device):
        out = model(input_ids=x, labels=x)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=device)
    return (out.loss - args.aux_coef * aux).detach(), aux.detach()


def choose_experts_implementation(model, params, batches: Batches, device) -> None:
    """transformers' default (grouped_mm: one kernel for all experts, where it runs), else the
    per-expert loop ("eager")."""
    x = batches.stream[: batches.seq_len][None].to(device)  # a probe, not from the generator
    for name in (None, "eager"):
        try:
            if name is not None:
                set_experts_implementation(model, name)
            with autocast(device):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            for p in params:
                p.grad = None
            log(f"experts implementation: {experts_implementation(model)}")
            return
        except Exception as e:  # noqa: BLE001 -- any failure means: try the next one
            log(f"experts implementation {experts_implementation(model)} failed here "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
            for p in params:
                p.grad = None
    raise RuntimeError("no experts implementation ran")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the whole script")
    ap.add_argument("--steps", type=int, default=None, help="exact step count (skips calibration; 0: calibrate)")
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--max-epochs", type=float, default=10.0, help="cap on tokens seen, in training-set passes")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss weight")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--min-corpus-chars", type=int, default=MIN_CORPUS_CHARS,
                    help="top the stdlib up from site-packages to this many characters (0: stdlib only)")
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke test: tiny model, corpus slice, few steps")
    args = ap.parse_args()
    t0 = time.time()
    if args.tiny:
        args.vocab, args.seq_len, args.batch = min(args.vocab, 512), 64, 8
        args.eval_every, args.log_every, args.warmup = 10, 5, 5
        args.steps = 30 if args.steps is None else args.steps
    args.steps = args.steps or None  # --steps 0: calibrate (also with --tiny)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    env = dict(python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__,
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    log(f"environment: {env}")

    root = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    files = corpus_files(root, None if args.tiny else site, args.min_corpus_chars)
    if args.tiny:
        files = files[:: max(1, len(files) // 120)]
    train_files = [(r, t) for r, t in files if not is_heldout(r)]
    held_files = [(r, t) for r, t in files if is_heldout(r)]
    train_texts, held_texts = [t for _, t in train_files], [t for _, t in held_files]
    log(f"split: {len(train_files)} training files ({sum(map(len, train_texts)) / 1e6:.1f} M chars), "
        f"{len(held_files)} held out ({sum(map(len, held_texts)) / 1e6:.2f} M chars)")

    t = time.time()
    tok = train_tokenizer(train_texts, args.vocab)
    vocab_used = tok.get_vocab_size(with_added_tokens=True)
    eot = tok.token_to_id(EOT)
    train_ids, held_ids = encode_stream(tok, train_texts), encode_stream(tok, held_texts)
    log(f"tokenizer: {vocab_used} tokens in {time.time() - t:.1f} s; training stream {len(train_ids) / 1e6:.2f} M "
        f"tokens ({sum(map(len, train_texts)) / len(train_ids):.2f} chars/token), held-out {len(held_ids) / 1e6:.3f} M")

    model = build_model(args, args.vocab, eot).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    log(f"model: {n_params / 1e6:.2f} M parameters ({expert_params / 1e6:.2f} M in routed experts)")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    batches = Batches(train_ids, args.seq_len, args.batch, args.seed, device)
    choose_experts_implementation(model, list(model.parameters()), batches, device)

    n_eval = min(len(held_ids) // args.seq_len, (EVAL_TOKENS // 16 if args.tiny else EVAL_TOKENS) // args.seq_len)
    eval_windows = torch.from_numpy(held_ids[: n_eval * args.seq_len].astype(np.int64)).view(n_eval, args.seq_len)
    t = time.time()
    eval_loss0 = evaluate(model, eval_windows, device, args.batch)
    eval_seconds = time.time() - t
    log(f"held-out loss before training: {eval_loss0:.4f} ({eval_seconds:.1f} s per evaluation, {n_eval} windows)")

    tokens_per_step = args.batch * args.seq_len
    epoch_steps = len(train_ids) / tokens_per_step
    cap = min(args.max_steps, int(args.max_epochs * epoch_steps))
    total = args.steps if args.steps else None
    losses, evals = [], [dict(step=0, loss=eval_loss0)]
    best = (eval_loss0, 0, {k: v.detach().clone() for k, v in model.state_dict().items()})
    budget = args.minutes * 60
    run_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    t_train, step, stopped_early = time.time(), 0, False
    while total is None or step < total:
        if total is None and step == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_cal = time.time()
        if total is None and step == 2 + CALIBRATION_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = (time.time() - t_cal) / CALIBRATION_STEPS
            per_step = step_s + eval_seconds / args.eval_every
            left = budget - (time.time() - t0) - 2 * eval_seconds - 30  # 30 s: final save and tar
            total = max(step + 1, min(cap, step + int(SAFETY * left / per_step)))
            log(f"calibration: {step_s * 1000:.1f} ms/step ({tokens_per_step / step_s / 1e3:.0f} k tokens/s); "
                f"{total} steps planned ({total * tokens_per_step / 1e6:.0f} M tokens, "
                f"{total / epoch_steps:.2f} epochs; cap {cap})")
        lr = lr_at(step, total or cap, args)
        lm, aux = train_step(model, opt, batches.next(), lr, args, device)
        run_sum += lm
        aux_sum += aux
        step += 1
        if step % args.log_every == 0:
            mean, mean_aux = float(run_sum) / args.log_every, float(aux_sum) / args.log_every
            run_sum.zero_()
            aux_sum.zero_()
            losses.append(dict(step=step, loss=mean, aux=mean_aux, lr=lr, seconds=round(time.time() - t_train, 2)))
            log(f"step {step:6d}  loss {mean:.4f}  aux {mean_aux:.3f}  lr {lr:.2e}  "
                f"{step * tokens_per_step / 1e6:8.1f} M tok  {time.time() - t0:6.0f} s")
        if step % args.eval_every == 0 or step == total:
            e = evaluate(model, eval_windows, device, args.batch)
            evals.append(dict(step=step, loss=e))
            log(f"step {step:6d}  held-out loss {e:.4f}  (ppl {math.exp(e):.2f})")
            if e < best[0]:
                best = (e, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if not args.steps and time.time() - t0 > budget - 30 and step < (total or cap):
            stopped_early = True
            log(f"wall-clock budget reached at step {step}")
            break
    train_seconds = time.time() - t_train
    if evals[-1]["step"] != step:
        e = evaluate(model, eval_windows, device, args.batch)
        evals.append(dict(step=step, loss=e))
        if e < best[0]:
            best = (e, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    log(f"trained {step} steps, {step * tokens_per_step / 1e6:.1f} M tokens in {train_seconds:.0f} s; "
        f"saving step {best[1]} (held-out loss {best[0]:.4f}, ppl {math.exp(best[0]):.2f})")

    hf = Path(tempfile.mkdtemp(prefix="strata-train-")) / "hf"  # not under --out: only pack()'s files go there
    model.config.use_cache = True
    model.config.output_router_logits = False
    model.to(torch.float16).save_pretrained(hf, max_shard_size=SHARD_SIZE)
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token=EOT, pad_token=EOT, bos_token=None, unk_token=None,
        model_max_length=model.config.max_position_embeddings, clean_up_tokenization_spaces=False), indent=2) + "\n")
    (hf / "heldout.txt").write_text(heldout_sample(held_files), encoding="utf-8")
    (hf / "train_log.json").write_text(json.dumps(dict(
        environment=env, args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        corpus=dict(stdlib=str(root), site_packages=str(site), files=len(files),
                    stdlib_files=sum(r.startswith("stdlib/") for r, _ in files), train_files=len(train_files), heldout_files=len(held_files),
                    train_tokens=int(len(train_ids)), heldout_tokens=int(len(held_ids)),
                    heldout_rule=f"sha256(prefixed relative path)[:4] % 1000 < {HELDOUT_PERMILLE}"),
        tokenizer_vocab=vocab_used, parameters=n_params, expert_parameters=expert_params,
        experts_implementation=experts_implementation(model),
        steps=step, planned_steps=total, stopped_early=stopped_early, tokens_per_step=tokens_per_step,
        tokens_seen=step * tokens_per_step, epochs=step / epoch_steps, train_seconds=round(train_seconds, 1),
        script_seconds=round(time.time() - t0, 1), saved_step=best[1], saved_heldout_loss=best[0],
        heldout_eval_tokens=int(eval_windows.numel()), losses=losses, evals=evals), indent=1) + "\n")
    pack(hf, args.out)
    shutil.rmtree(hf.parent)
    log(f"done in {time.time() - t0:.0f} s")
    return 0


def pack(hf: Path, out: Path) -> None:
    """Shards to `out/`, the small files into `out/small.tar`; check the device's return limits."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in SMALL_FILES:
            if (hf / name).exists():
                tar.add(hf / name, arcname=name)
    (out / "small.tar").write_bytes(buf.getvalue())
    shards = sorted(hf.glob("*.safetensors"))
    for s in shards:
        s.replace(out / s.name)
    files = [out / "small.tar", *(out / s.name for s in shards)]
    sizes = {f.name: f.stat().st_size for f in files}
    log(f"output: {json.dumps(sizes)}; total {sum(sizes.values()) / 2**20:.1f} MiB in {len(files)} files")
    too_big = [n for n, s in sizes.items() if s > MAX_FILE_BYTES]
    if too_big or len(files) > 7 or sum(sizes.values()) > 60 * 2**20:
        log(f"WARNING: outside the device's return limits: {too_big or 'count/total'}")


if __name__ == "__main__":
    sys.exit(main())
