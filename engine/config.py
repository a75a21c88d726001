"""Configuration: small frozen dataclasses that check themselves."""
from __future__ import annotations

from dataclasses import dataclass, field

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "float16", "bfloat16")
PRECISIONS = ("auto", "fp32", "fp16", "bf16", "int8")
PRECISION_DTYPES = {"fp32": "float32", "int8": "float32", "fp16": "float16", "bf16": "bfloat16"}
KV_DTYPES = ("auto", "fp32", "fp16", "int8")
ATTENTIONS = ("auto", "sdpa", "eager")
DEFAULT_BLOCK_TOKENS = 16  # tokens per KV block

# speculative decoding's methods (engine/speculative.py)
PROMPT_LOOKUP = "prompt-lookup"
DRAFT_PREFIX = "draft:"  # "draft:PATH": a smaller model with the same tokenizer drafts
METHODS = (PROMPT_LOOKUP, DRAFT_PREFIX + "PATH")


def check_method(method: str | None) -> None:
    if method is not None and method != PROMPT_LOOKUP and not (method.startswith(DRAFT_PREFIX) and
                                                                 len(method) > len(DRAFT_PREFIX)):
        raise ValueError(f"speculative must be one of {', '.join(METHODS)}, got {method!r}")


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")


# The repetition penalty a chat starts with (the page's setting, `phasescope chat`), Ollama's default. At 1.0
# the bundled model loops ("Aria's beauty," fifty times over). Measured over 18 sampled int8 replies (six
# prompts, English and Chinese, temperature 0.7, three seeds): distinct 4-grams 0.86 -> 0.99 of a reply
# (the worst reply 0.25 -> 0.81), replies no longer (1.2 made 15 of 18 run to the limit), TPOT within
# noise. Elsewhere (SamplingParams, `generate`, the API) it stays off, 1.0, as in vLLM and transformers.
CHAT_REPETITION_PENALTY = 1.1
# The top-p a chat starts with, Ollama's default too. With top-p 1.0 the bundled model's long tail of
# unlikely tokens takes it off course ("What is the capital of France?" - "Gabon: My best friend and
# ..."): five factual questions, eight seeds each, temperature 0.7, penalty 1.1, answered right 19 of 40
# times with 1.0 and 27 with 0.9 (greedy: 24); distinct 4-grams over 24 replies of eight prompts 0.99
# both ways (no loops).
CHAT_TOP_P = 0.9


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    repetition_penalty: float = 1.0  # CTRL's, over the prompt and the reply (transformers, vLLM)
    frequency_penalty: float = 0.0  # OpenAI's, over the reply: minus this times a token's count so far
    presence_penalty: float = 0.0  # OpenAI's, over the reply: minus this once a token has appeared
    # OpenAI's: (token id, added to its logit) pairs, or a dict; -100 to 100
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    # each prompt token's probability given those before it, reported with its prefill chunk (echo with
    # logprobs); every prompt token is then prefilled, none taken from the prefix cache
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        _check_range("temperature", self.temperature, 0.0, 10.0)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        for token_id, value in bias:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias takes token ids >= 0, got {token_id!r}")
            _check_range(f"logit_bias of token {token_id}", value, -100.0, 100.0)
        object.__setattr__(self, "logit_bias", tuple((int(i), float(b)) for i, b in bias))
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1 (torch's generator's range) or None "
                             f"(random), got {self.seed!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a sequence of non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes_reply(self) -> bool:
        """Whether the frequency or presence penalty reads the tokens generated so far."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for and how much may wait, each refused with a one-line message (UI, CLI
    and API alike) rather than left to grow.

    max_prompt_tokens: prompt tokens after the chat template; None: the model's context window.
    max_new_tokens: the most tokens one request may ask for.
    max_waiting: requests queued behind the running batch; one more is refused as busy (HTTP 429).
    max_message_chars: characters in one message.
    request_timeout_s: a request still running after this long (from submit) ends with an error, its
        text so far kept; None: no limit.
    """

    max_prompt_tokens: int | None = None
    max_new_tokens: int = 8192
    max_waiting: int = 64
    max_message_chars: int = 100_000
    request_timeout_s: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_waiting", "max_message_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int)
                                                   or self.max_prompt_tokens < 1):
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {self.max_prompt_tokens!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s!r}")


# the engine's optimization switches (EngineConfig.switches)
SWITCHES = ("kv_cache", "prefix_caching", "speculative", "draft_tokens", "kv_dtype", "kv_window", "kv_sinks",
            "split_kv", "attention", "prefill_chunk", "tensor_parallel", "compile_decode", "bind_threads")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Which model to run, where, and how prefill is split.

    model: None for the bundled SmolLM2-135M-Instruct, else a local Hugging Face folder or a .gguf file.
    precision: the weights' number format: fp32 (the reference), fp16, bf16, int8 (weights int8,
        activations quantized per call; lean path on CPU), or auto: int8 for a Llama-family model on CPU
        where the native decode step builds, else the dtype's (fp32 on CPU, bf16 on CUDA).
    prefill_chunk: prompt tokens per prefill forward pass; 0 means the whole prompt in one pass.
    kv_cache_mb: the KV pool's size in MB (10^6 bytes); None: an eighth of the machine's memory, at most 2 GiB.
    kv_block_tokens: tokens per KV block (the unit of paging and of prefix reuse).
    prefix_caching: reuse the KV of prompt prefixes already in the pool (earlier turns, shared system
        prompts); off: every prompt is prefilled whole.
    max_running: requests decoded together at most (the batch); more wait in line.
    max_step_tokens: tokens one scheduler step runs at most (decodes + prefill chunks), so that a long
        prompt is prefilled in chunks between the running requests' decode steps.
    kv_cache: keep keys and values between decode steps; off (the baseline that shows why the cache
        exists), every decode step recomputes the whole sequence and prefix caching is off.
    speculative: None; "prompt-lookup": draft tokens from earlier text; or "draft:PATH": a smaller model
        with the same tokenizer drafts them. Either way the target verifies them in one forward
        (engine/speculative.py); draft_tokens: the most drafted at once.
    kv_dtype: the KV cache's number format: auto (the activations': fp32 for fp32 and int8 weights), fp32,
        fp16 (half the bytes per token; the keys and values rounded to fp16 as they are stored) or int8
        (each head's row of keys or values as int8 with its own fp32 scale: 68 bytes for 64 values).
    kv_window, kv_sinks: a sliding window with attention sinks (StreamingLLM): once a sequence's cache
        holds the first kv_sinks tokens and the last kv_window (whole blocks of kv_block_tokens), each
        new block's worth of tokens pushes the oldest non-sink block out: the cache stops growing. None:
        keep everything. Prefix caching and speculation are off with it.
    attention: prefill's attention: auto (the native kernel reading the paged cache in place, where it is
        built; else sdpa), sdpa (PyTorch's fused scaled_dot_product_attention) or eager (the score
        matrix materialized: QK^T, mask, softmax, times V).
    limits: what one request may ask for, and how many may wait (Limits).
    split_kv: Flash Decoding in the native decode step: the attention of a sequence longer than 512
        positions cut into chunks that the threads share, merged exactly (log-sum-exp). On by default: with
        3 KV heads on 2 threads one thread would otherwise attend for two of them (see the README).
    bind_threads: each of the forward's threads on a CPU of its own (the native step's OpenMP team, which
        PyTorch's ops share), instead of wherever the OS puts them. Off by default, as PyTorch and
        llama.cpp leave them; on, a machine where another program is busy slows the forward far less
        (measured with a process spinning on one of two cores: TTFT 23-30 ms against 133-162, decode
        82-89 tokens/s against 43-59). Needs the native decode step, in this process.
    compile_decode: on CUDA, torch.compile each CUDA-graph decode step before it is captured: its small
        kernels fused, fewer per replay (measured on an H200: 718 vs 472 tok/s at batch 1), for about 25 s
        of compilation the first time each batch and context bucket is met. Off by default.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    precision: str = "auto"
    prefill_chunk: int = 0
    cache_dir: str | None = None
    kv_cache_mb: float | None = None
    kv_block_tokens: int = DEFAULT_BLOCK_TOKENS
    prefix_caching: bool = True
    max_running: int = 16
    max_step_tokens: int = 2048
    kv_cache: bool = True
    speculative: str | None = None
    draft_tokens: int = 8
    split_kv: bool = True
    kv_dtype: str = "auto"
    kv_window: int | None = None
    kv_sinks: int = 4
    attention: str = "auto"
    tensor_parallel: int = 1
    compile_decode: bool = False
    bind_threads: bool = False
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be an integer >= 0 (0 = whole prompt), got {self.prefill_chunk!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        check_method(self.speculative)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.kv_window is not None:
            if not isinstance(self.kv_window, int) or self.kv_window < 1:
                raise ValueError(f"kv_window must be an integer >= 1 (tokens), got {self.kv_window!r}")
            if self.speculative:
                raise ValueError("speculative decoding rolls the cache back, which a sliding window cannot: "
                                 "use one or the other")
        if not isinstance(self.kv_sinks, int) or self.kv_sinks < 0:
            raise ValueError(f"kv_sinks must be an integer >= 0, got {self.kv_sinks!r}")
        if self.speculative and not self.kv_cache:
            raise ValueError("speculative decoding verifies drafts against the KV cache: it cannot run without one")
        for name in ("kv_block_tokens", "max_running", "max_step_tokens", "draft_tokens", "tensor_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_step_tokens <= self.max_running:
            raise ValueError(f"max_running ({self.max_running}) must be below max_step_tokens ({self.max_step_tokens}, "
                             "the tokens one step runs), or prompts could never be prefilled beside a full batch")
        if self.kv_cache_mb is not None and (not isinstance(self.kv_cache_mb, (int, float)) or self.kv_cache_mb <= 0):
            raise ValueError(f"kv_cache_mb must be a number of MB > 0, got {self.kv_cache_mb!r}")

    @property
    def load_dtype(self) -> str:
        """The dtype the weights are loaded in: the precision's, else the dtype setting."""
        return PRECISION_DTYPES.get(self.precision, self.dtype)

    def switches(self) -> dict:
        """The optimization switches set away from their defaults, by name (what a reply's record says of how
        the engine ran it, beside its precision): {} for an engine as it comes."""
        defaults = EngineConfig()
        changed = {name: getattr(self, name) for name in SWITCHES if getattr(self, name) != getattr(defaults, name)}
        if not self.speculative:
            changed.pop("draft_tokens", None)
        if not self.kv_window:
            changed.pop("kv_sinks", None)
        return changed
