"""Events the engine reports, in this order for one request:

Started, PrefillChunk (one per chunk), FirstToken, DecodeStep (one per generated token), Finished.

Every event carries the request id and `t_ms`, the time since the request was submitted, read on the
server after a device synchronize. Subscribers are plain callables taking one event.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class Speculation:
    """What speculative decoding did for one request."""

    drafted: int  # draft tokens proposed
    accepted: int  # of those, kept
    forwards: int  # decode forwards the request took (with a draft or without)
    tokens: int  # tokens those forwards produced

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None


# The stages of one forward pass, in order, as an explained request's events time them (stage_ms); the
# order of the native step's Stage enum (csrc/decode_step.cpp). "norm" adds up the RMSNorms of every layer,
# "attention" the QKV projection, rotary embedding, cache write, attention and output projection of every
# layer, "ffn" the gate/up projection, SiLU and down projection of every layer.
FORWARD_STAGES = ("embedding", "norm", "attention", "ffn", "final_norm", "lm_head")
# Beside them in stage_ms, not a stage: the time the forward's CPU threads took to wake before it, inside its
# time (forward_ms, latency_ms). A forward after a pause (explain mode's Next token) pays it; one in a stream
# of tokens finds them awake (see LeanLlama.wake_threads).
WAKE = "wake"


@dataclass(frozen=True, slots=True)
class Event:
    request_id: str
    t_ms: float

    @property
    def type(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict:
        """Plain JSON-ready data (dataclasses.asdict deep-copies: ~10x slower, and this runs per token)."""
        data = {"type": self.type, **_plain(self)}
        data.pop("attention", None)  # a tensor, for the explain mode's own use
        return data


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _plain(value):
    kind = type(value)
    if kind in _SCALARS:  # most fields: checked first, since this runs for every field of every token
        return value
    fields = getattr(kind, "__dataclass_fields__", None)
    if fields is not None:
        return {name: _plain(getattr(value, name)) for name in fields}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Started(Event):
    """The request left the queue; its prompt is templated and tokenized."""

    num_prompt_tokens: int
    max_new_tokens: int
    kv_capacity_tokens: int
    kv_capacity_bytes: int
    model_path: str  # which forward runs it: "lean-llama" or "transformers"
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the pool (prefix caching): not prefilled
    # how the engine runs it: the weights' precision and the switches set away from their defaults,
    # {"precision": "int8", "kv_cache": False} (Engine.setup); None where not known (a remote endpoint)
    engine: dict | None = None


@dataclass(frozen=True, slots=True)
class TopToken:
    token_id: int
    text: str
    prob: float  # the model's probability (softmax of the raw logits)
    # its probability under the rule that picked the token (after the penalties, temperature, top-k
    # and top-p; greedy: 1 for the one taken, else 0)
    sample_prob: float | None = None


@dataclass(frozen=True, slots=True)
class PromptToken:
    """A prompt token's probability given the prompt before it (a request that asked for prompt_logprobs)."""

    position: int
    token_id: int
    prob: float  # softmax of the raw logits at the position before
    top: tuple[TopToken, ...]  # the five most likely tokens there


@dataclass(frozen=True, slots=True)
class PrefillChunk(Event):
    """One prefill forward pass over prompt tokens [start, end); the first chunk starts after the
    tokens taken from the cache."""

    chunk_index: int
    start: int
    end: int
    num_prompt_tokens: int
    latency_ms: float
    kv_tokens: int
    kv_bytes: int
    stage_ms: dict | None = None  # an explained request's time per FORWARD_STAGES, and WAKE (ms)
    comm_ms: float = 0.0  # of latency_ms, the time in collectives (tensor parallelism's all-reduces)
    # with prompt_logprobs: the prompt tokens at positions [start + 1, end + 1) (the last prompt token's
    # row gives the first generated token instead): every prompt token but the first, over the chunks
    prompt_logprobs: tuple[PromptToken, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class FirstToken(Event):
    """The first generated token is available: TTFT and where it went."""

    ttft_ms: float
    tokenize_ms: float  # chat template + tokenization
    queue_ms: float  # waiting for the engine
    setup_ms: float  # KV cache allocation and event delivery before the first forward ends
    prefill_ms: float  # all prefill forward passes
    first_sample_ms: float  # sampling the first token from the prefill's logits


@dataclass(frozen=True, slots=True)
class DecodeStep(Event):
    """One generated token. Step 0 samples from the prefill's logits (no forward of its own);
    each later step runs one forward pass over the previous token, then samples."""

    step: int
    token_id: int
    text: str  # the text this token completes ("" while a multi-byte character is unfinished)
    latency_ms: float  # since the previous token was available; for step 0 since submit, i.e. TTFT
    kv_tokens: int
    kv_bytes: int
    prob: float | None  # the model's probability of this token (softmax of the logits); None: unknown (remote)
    top: tuple[TopToken, ...]  # the five most likely tokens at this step
    batch_size: int = 1  # sequences in the decode forward this token came from (step 0: its prefill, 1)
    forward_ms: float = 0.0  # the decode forward this token came from (shared by its batch); step 0: 0
    # the step's attention weights, a float32 tensor [layers, heads, positions], when the request asked
    # for them (explain mode; to_dict leaves them out)
    attention: object | None = None
    # an explained request's time per FORWARD_STAGES of the decode forward, WAKE, and "sample" (ms)
    stage_ms: dict | None = None
    flops: int = 0  # the floating-point operations of this token's row of the forward (0 for step 0)
    draft: bool = False  # a drafted token the forward verified: it came with the token before it (a burst)
    comm_ms: float = 0.0  # of forward_ms, the time in collectives (tensor parallelism's all-reduces)
    # of latency_ms, the time the engine spent on named calls (the Lab's: see Finished.held_ms) since the
    # token before: the request waited for them here
    held_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Finished(Event):
    """The request ended. reason: eos, length, stop, cancelled or error."""

    reason: str
    text: str
    metrics: RequestMetrics
    error: str | None = None
    speculation: Speculation | None = None  # what speculative decoding did, when the engine speculates
    # a remote server's own figures (app/remote): its timings, its /metrics before and after, by name
    server: dict | None = None
    # ms the request waited, while active, for a measurement that held the engine (Engine.call's name:
    # "lab", "precision"), by name; its TTFT or TPOT include them
    held_ms: dict | None = None


Hook = Callable[[Event], None]
