"""The toy GRPO task: echo (or reverse) a short string; reward = fraction of correct
characters.

A prompt is ``<bos> c1 .. cL =`` with the ``ci`` drawn from a small alphabet; the
policy must answer ``c1 .. cL`` (``mode="copy"``) or ``cL .. c1`` (``"reverse"``) in
exactly ``L`` new tokens (no end token: completions have a fixed length, so every
sample is scored on the same number of positions). The reward is verifiable from the
prompt alone and gives partial credit per character, which is what lets GRPO climb
from a random initialisation within a few steps: first by answering with alphabet
characters at all (reward ~1/|alphabet|), then by putting them in the right places.
Copying is a constant-offset lookback, which a 2-layer model finds within ~20 steps
(measured: 0.05 -> 0.3-0.5 mean reward in 20 steps of 16 prompts x 8 samples, lr 5e-3);
reversal needs a position-dependent offset and mostly stays at the alphabet level
(~0.25) for that long.

The policy is a tiny Qwen3 (tied embeddings, q/k norms) over a 23-token character
vocabulary: 23 is a multiple of neither vLLM's padding (64) nor Megatron's
(128·tp), so both sides carry padded vocabulary rows the refit must skip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..spec.model import ModelSpec, load_model_spec

PAD, BOS, SEP = "<pad>", "<bos>", "="
LETTERS = "abcdefghijklmnopqrst"
VOCAB: tuple[str, ...] = (PAD, BOS, SEP, *LETTERS)  # 23 tokens

# HF config of the policy (Qwen3ForCausalLM, so the vLLM Qwen3 layout applies).
# rope_theta and rms_norm_eps are repeated in GrpoConfig: the ModelSpec keeps shapes only.
POLICY_CONFIG: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=len(VOCAB),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    torch_dtype="float32",
    bos_token_id=VOCAB.index(BOS),
    pad_token_id=VOCAB.index(PAD),
)


# What may be resized (vocabulary, heads and head_dim stay): a larger policy makes the
# refit move more bytes, e.g. to compare refit backends beyond per-message latency.
POLICY_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers")


def policy_config(**sizes: int) -> dict[str, Any]:
    """``POLICY_CONFIG`` with some of ``POLICY_SIZES`` changed."""
    unknown = sorted(set(sizes) - set(POLICY_SIZES))
    if unknown:
        raise ValueError(f"cannot resize {unknown} of the policy; resizable: {POLICY_SIZES}")
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"policy sizes must be integers >= 1, got {bad}")
    return {**POLICY_CONFIG, **sizes}


def policy_spec(config: dict[str, Any] | None = None) -> ModelSpec:
    """The canonical tensors of the tiny policy (or of ``config``, see :func:`policy_config`)."""
    return load_model_spec(dict(POLICY_CONFIG if config is None else config))


class CharTokenizer:
    """One token per character; ``<pad>`` and ``<bos>`` are single tokens too."""

    def __init__(self, vocab: tuple[str, ...] = VOCAB) -> None:
        self.vocab = vocab
        self.ids = {s: i for i, s in enumerate(vocab)}

    def encode(self, text: str, bos: bool = False) -> list[int]:
        try:
            return [self.ids[BOS]] * bos + [self.ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Tensor | list[int]) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


MODES = ("copy", "reverse")


@dataclass(frozen=True)
class StringTask:
    """Echo (``mode="copy"``) or reverse ``length`` characters drawn from ``alphabet``."""

    length: int = 4
    alphabet: str = "abcd"
    mode: str = "copy"

    def __post_init__(self) -> None:
        if self.length < 1 or not self.alphabet or set(self.alphabet) - set(LETTERS):
            raise ValueError(f"need length >= 1 and an alphabet within {LETTERS!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown task mode {self.mode!r}; choose one of {MODES}")

    @property
    def prompt_len(self) -> int:
        return self.length + 2  # <bos> c1..cL =

    @property
    def completion_len(self) -> int:
        return self.length

    def sample_prompts(self, n: int, generator: torch.Generator) -> Tensor:
        """[n, prompt_len] int64 prompts, reproducible from ``generator``'s state."""
        tok = CharTokenizer()
        letters = torch.tensor(tok.encode(self.alphabet))
        picks = torch.randint(0, len(self.alphabet), (n, self.length), generator=generator)
        bos = torch.full((n, 1), tok.ids[BOS])
        sep = torch.full((n, 1), tok.ids[SEP])
        return torch.cat([bos, letters[picks], sep], dim=1)

    def targets(self, prompts: Tensor) -> Tensor:
        """The correct completions [B, length]: the prompt's characters (reversed)."""
        chars = prompts[:, 1 : 1 + self.length]
        return chars.flip(1) if self.mode == "reverse" else chars

    def reward(self, prompts: Tensor, completions: Tensor) -> Tensor:
        """float32 [B]: the fraction of completion positions holding the right character."""
        if completions.shape != (prompts.shape[0], self.length):
            raise ValueError(
                f"completions of shape {tuple(completions.shape)}; expected "
                f"({prompts.shape[0]}, {self.length})"
            )
        return (completions == self.targets(prompts)).float().mean(dim=1)
