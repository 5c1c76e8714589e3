"""Regenerate tests/fixtures/: the tiny Hugging Face checkpoints the convert tests read, and what
transformers computes on them. Needs torch (the test suite does not):

    pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install -e ".[test,regen]"
    python scripts/make_hf_fixtures.py              # every family, then every GGUF case
    python scripts/make_hf_fixtures.py olmoe        # one family (and the GGUF cases built from it)
    python scripts/make_hf_fixtures.py --gguf       # only the GGUF cases' logits

For each architecture in tests/hf_fixtures.fixture_archs(): its builder (tests/hf_models.py,
tests/hf_hybrid.py, tests/hf_gpt_oss.py, tests/hf_qwen4.py) trains and saves the checkpoint with a fixed seed into
tests/fixtures/hf/<arch>/, and transformers' float32 outputs on it are written beside it as
expected.npz. For each GGUF case (tests/gguf_models.py CASES and WIDE_CASE): the GGUF is written
from the checked-in checkpoint, dequantized, and transformers' logits on the dequantized weights
go to tests/fixtures/gguf/<case>.npz with the digest of those weights. Run from the repository
root; prints each fixture's size and the total.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import gguf_models, hf_fixtures, hf_reference  # noqa: E402


def build_family(arch: str) -> None:
    """tests/fixtures/hf/<arch>/: the checkpoint and expected.npz, replaced whole."""
    final = hf_fixtures.HF_ROOT / arch
    final.parent.mkdir(parents=True, exist_ok=True)
    # built beside the others (qwen3_5_moe reads its sibling qwen3_5_moe_text), then renamed in
    work = final.parent / f".{arch}.partial"
    shutil.rmtree(work, ignore_errors=True)
    try:
        model = hf_fixtures.family_of(arch).build_checkpoint(arch, work)
        np.savez(work / hf_fixtures.EXPECTED, **hf_reference.expected_outputs(model, work))
        shutil.rmtree(final, ignore_errors=True)
        work.rename(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_gguf_case(case: tuple, tmp: Path) -> None:
    """tests/fixtures/gguf/<case>.npz: transformers' logits on the case's dequantized weights."""
    arch, experts, dense = case[:3]
    name = gguf_models.case_id(case)
    work = tmp / name
    if arch == gguf_models.WIDE_CASE[0]:
        hf_dir = gguf_models.build_wide_checkpoint(work / "hf")
    else:
        hf_dir = hf_fixtures.copy_checkpoint(arch, work / "hf")
    path = gguf_models.write_gguf(hf_dir, work / "model.gguf", experts=experts, dense=dense)
    ref_dir = gguf_models.dequantized_checkpoint(path, hf_dir, work / "dequantized")
    tokens = hf_reference.parity_tokens(hf_dir)
    logits = hf_reference.logits(hf_reference.load_model(ref_dir), tokens)
    hf_fixtures.GGUF_ROOT.mkdir(parents=True, exist_ok=True)
    np.savez(hf_fixtures.GGUF_ROOT / f"{name}.npz", logits=logits,
             weights_digest=np.asarray(gguf_models.weights_digest(ref_dir)))


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    known = hf_fixtures.fixture_archs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", metavar="ARCH", help=f"default: all of {', '.join(known)}")
    parser.add_argument("--gguf", action="store_true", help="only the GGUF cases' logits")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.archs) - set(known))
    if unknown:
        parser.error(f"unknown architecture {unknown[0]!r} (known: {', '.join(known)})")
    hf_reference.setup_torch()
    archs = [] if args.gguf else [a for a in known if a in args.archs or not args.archs]
    for arch in archs:
        build_family(arch)
        print(f"{arch}: {_size(hf_fixtures.HF_ROOT / arch) / 1e6:.2f} MB")
    cases = [*gguf_models.CASES, gguf_models.WIDE_CASE]
    if args.archs:
        cases = [c for c in cases if c[0] in args.archs]
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            build_gguf_case(case, Path(tmp))
            print(f"gguf {gguf_models.case_id(case)}: "
                  f"{_size(hf_fixtures.GGUF_ROOT / (gguf_models.case_id(case) + '.npz')) / 1e6:.2f} MB")
    print(f"tests/fixtures: {_size(hf_fixtures.ROOT) / 1e6:.2f} MB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
