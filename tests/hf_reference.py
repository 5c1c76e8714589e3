"""What transformers computes on a checkpoint, with torch: the fixtures' expected outputs.

scripts/make_hf_fixtures.py writes these into tests/fixtures/; tests/test_hf_fixtures.py
recomputes them where torch is installed, to check that the checked-in ones are current.
Nothing else in the suite imports this module (the suite needs no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests import hf_fixtures, hf_models


def setup_torch() -> None:
    """One thread (these models are tiny: ~5x faster than two threads fighting over small ops,
    and the fixtures are built with it), no progress bars, no network."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()


def load_model(directory: Path):
    """The checkpoint in `directory` as transformers loads it, in float32, in eval mode: the class
    its config.json names."""
    import torch
    import transformers

    config = json.loads((directory / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    kw = {}
    if config.get("quantization_config", {}).get("quant_method") == "mxfp4":
        # transformers' own dequantization of the blocks (its MXFP4 kernels need a GPU)
        kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return cls.from_pretrained(directory, dtype=torch.float32, **kw).eval()


def parity_tokens(directory: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids


def eos_ids(directory: Path) -> list[int]:
    """The ids strata's tokenizer stops on (its common end-of-sequence names and the checkpoint's
    eos_token): transformers' generate is given the same ones."""
    from strata.tokenizer import Tokenizer

    tok = Tokenizer.from_json((directory / "tokenizer.json").read_text(), eos_tokens=(hf_models.EOS_TOKEN,))
    return sorted(tok.eos_ids)


def logits(model, tokens) -> np.ndarray:
    """[T] -> [T, V] float32: transformers' teacher-forced forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))[None]).logits[0].float().numpy()


def greedy(model, prompt: list[int], eos: list[int]) -> list[int]:
    """transformers' generate(do_sample=False): GREEDY_STEPS new tokens after `prompt`."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(prompt)[None], max_new_tokens=hf_fixtures.GREEDY_STEPS, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def expected_outputs(model, directory: Path) -> dict[str, np.ndarray]:
    """expected.npz's arrays (tests/hf_fixtures.py gives their shapes) for `model`, the checkpoint
    in `directory` as transformers loads it."""
    tokens = parity_tokens(directory)
    prompt = tokens[: hf_fixtures.PROMPT_TOKENS]
    eos = eos_ids(directory)
    return {"tokens": np.asarray(tokens, np.int32), "logits": logits(model, tokens),
            "prompt": np.asarray(prompt, np.int32), "greedy": np.asarray(greedy(model, prompt, eos), np.int32),
            "eos_ids": np.asarray(eos, np.int32)}
