"""The generation loop of the embedded inference server (one background thread).

Requests queue up; each iteration the thread admits waiting requests (prefilled together,
then merged into the running batch) and advances every running request by one token.
Control commands (pause, abort, memory release, weight updates, ...) run between iterations,
so a forward pass never races a weight swap. Results go back through
``concurrent.futures.Future``. The weight-update commands live in
:mod:`areal.inference.weight_updates`.

A failure that can be pinned on one request fails that request alone: a prefill forward
pass that raises is retried one request at a time, and a row the sampler cannot sample
(:class:`~areal.inference.sampling.SamplingError`, or any error when that row is sampled
alone) fails only its request. Requests whose future was cancelled (an HTTP deadline) leave
the batch at the next step. Only a decode forward pass that raises fails the whole batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from areal import models
from areal.inference.batch import RunningBatch, cache_kwarg, prefill_inputs
from areal.inference.cache_rows import new_cache
from areal.inference.errors import RequestError, SequenceError, settle
from areal.inference.sampling import SamplingParams, SamplingParamsError, sample_tokens
from areal.inference.weight_group import JOIN_TIMEOUT_S
from areal.inference.weight_updates import WeightUpdates
from areal.utils import logging

__all__ = [
    "GenerationEngine",
    "GenerationRequest",
    "GenerationResult",
    "RequestError",
    "SequenceError",
]

logger = logging.getLogger("inference.engine")

ABORT_BEFORE_PREFILL = "Abort before prefill"
# a loop turn that takes longer than this (no step or command does) is a frozen server
STALL_SECONDS = 60.0


@dataclass
class GenerationRequest:
    input_ids: list[int]
    params: SamplingParams
    rid: str


@dataclass
class GenerationResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    latency: float
    ttft: float | None


@dataclass
class _Sequence:
    request: GenerationRequest
    future: concurrent.futures.Future
    stop_ids: set[int]
    max_new_tokens: int
    generator: torch.Generator | None
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)


class GenerationEngine(WeightUpdates):
    """Continuous batching over a ``transformers`` causal LM."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        dtype: str = "auto",
        context_length: int | None = None,
        max_running_requests: int = 64,
        max_prefill_tokens: int = 16384,
        seed: int = 0,
        tp_size: int = 1,
        weight_group_timeout: float = JOIN_TIMEOUT_S,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = str(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, dtype)
        torch.manual_seed(seed)
        models.register()  # model families transformers does not resolve on its own
        config = AutoConfig.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.dtype, attn_implementation="sdpa", use_kernels=False
        ).to(self.device)  # no hub kernels: they are fetched online at load
        self.model.eval()
        self.vocab_size = int(config.vocab_size)
        max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.context_length = int(context_length or max_positions or 32768)
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = self._eos_ids(config)
        self.tokenizer = self._load_tokenizer()
        self._cache_kw = cache_kwarg(self.model)

        self._lock = threading.Lock()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._admitting: list[_Sequence] = []  # taken from the queue, not yet running
        self._batch = RunningBatch()
        self._commands: collections.deque[tuple[str, dict, concurrent.futures.Future]] = (
            collections.deque()
        )
        self._wake = threading.Event()
        self._paused = False
        self._released = False  # memory given back (colocation): no generation until resumed
        self._heartbeat = time.monotonic()  # the loop's last turn (see :meth:`stalled_for`)
        self._stopping = False
        self._closing = False  # a shutdown began (see begin_shutdown)
        self._init_weight_groups(weight_group_timeout)
        self.tp_devices = self._tp_devices(tp_size)
        self._thread = threading.Thread(target=self._loop, name="generation-engine", daemon=True)
        self.stats = collections.Counter()

    # --- setup ---

    def _eos_ids(self, config) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), config):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def _tp_devices(self, tp_size: int) -> list[torch.device]:
        """One device per TP rank of the weight-update group: consecutive GPUs, or CPU."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if self.device.type != "cuda":
            return [self.device] * tp_size
        first = self.device.index or 0
        if first + tp_size > torch.cuda.device_count():
            raise ValueError(
                f"tp_size {tp_size} from GPU {first} needs {first + tp_size} visible GPUs, "
                f"found {torch.cuda.device_count()}"
            )
        return [torch.device("cuda", first + k) for k in range(tp_size)]

    def _load_tokenizer(self):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.model_path)
        except (OSError, ValueError):
            return None  # token-id-only serving still works; stop strings do not

    def start(self) -> GenerationEngine:
        self._thread.start()
        return self

    def begin_shutdown(self) -> None:
        """Note that the server is going down (safe in a signal handler: it sets a flag).

        Callers waiting on a weight-update group join give up at once (see :attr:`closing`).
        """
        self._closing = True

    @property
    def closing(self) -> bool:
        return self._closing or self._stopping

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    # --- public, thread-safe API ---

    def validate(self, request: GenerationRequest) -> None:
        ids = request.input_ids
        if not ids:
            raise RequestError("input_ids must not be empty", "input_ids")
        for i, token in enumerate(ids):
            if (
                isinstance(token, bool)
                or not isinstance(token, int)
                or not 0 <= token < self.vocab_size
            ):
                raise RequestError(
                    f"input_ids[{i}]: token id {token!r} is outside the vocabulary "
                    f"(size {self.vocab_size})",
                    "input_ids",
                )
        if len(ids) >= self.context_length:
            raise RequestError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens).",
                "input_ids",
            )
        p = request.params
        try:
            p.verify()
        except SamplingParamsError as e:
            raise RequestError(f"sampling_params.{e}", f"sampling_params.{e.field}") from e
        # max_new_tokens None means up to the context length (SGLang's meaning)
        if p.max_new_tokens is not None and len(ids) + p.max_new_tokens >= self.context_length:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of "
                f"{len(ids) + p.max_new_tokens} tokens: {len(ids)} tokens from the input "
                f"and {p.max_new_tokens} tokens for the completion. Please reduce the "
                "number of tokens in the input or the completion.",
                "sampling_params.max_new_tokens",
            )
        if p.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need a tokenizer next to the model", "sampling_params.stop"
            )

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        """Queue a request; its future resolves to a :class:`GenerationResult`."""
        self.validate(request)
        params = request.params
        generator = None
        if params.sampling_seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.sampling_seed)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        max_new_tokens = params.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = self.context_length - len(request.input_ids) - 1
        seq = _Sequence(
            request=request,
            future=concurrent.futures.Future(),
            stop_ids=stop_ids,
            max_new_tokens=max_new_tokens,
            generator=generator,
        )
        with self._lock:
            self._waiting.append(seq)
        self._wake.set()
        return seq.future

    def command(self, name: str, **kwargs: Any) -> concurrent.futures.Future:
        """Run a control command between iterations (``pause``, ``continue``, ``abort``,
        ``update_weights``, ``update_weights_distributed``, ``release``, ``resume``)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._commands.append((name, kwargs, future))
        self._wake.set()
        return future

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    # --- the loop ---

    def _loop(self) -> None:
        while not self._stopping:
            self._heartbeat = time.monotonic()
            self._run_commands()
            if self._paused or self._released or (not self._running and not self._waiting):
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    self._drop_cancelled()
                    self._admit()
                    if self._running:
                        self._decode()
            except Exception as e:  # never let one bad batch kill the server
                logger.exception("generation step failed; aborting the running batch")
                self._fail_running(e)
        self._abort_all("server shutting down", include_waiting=True)

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                name, kwargs, future = self._commands.popleft()
            try:
                result = getattr(self, f"_cmd_{name}")(**kwargs)
            except Exception as e:
                settle(future, error=e)
            else:
                settle(future, result)

    def _take_waiting(self) -> list[_Sequence]:
        group: list[_Sequence] = []
        longest = 0
        with self._lock:
            while self._waiting and len(self._running) + len(group) < self.max_running:
                seq = self._waiting[0]
                longest_if_added = max(longest, len(seq.request.input_ids))
                if group and longest_if_added * (len(group) + 1) > self.max_prefill_tokens:
                    break
                group.append(self._waiting.popleft())
                longest = longest_if_added
        return group

    def _drop_cancelled(self) -> None:
        """Forget requests nobody waits for any more (their HTTP deadline passed)."""
        with self._lock:
            if any(s.future.cancelled() for s in self._waiting):
                self._waiting = collections.deque(
                    s for s in self._waiting if not s.future.cancelled()
                )
        keep = [i for i, s in enumerate(self._running) if not s.future.cancelled()]
        if len(keep) < len(self._running):
            self.stats["cancelled_requests"] += len(self._running) - len(keep)
            self._running = [self._running[i] for i in keep]
            self._batch.keep(keep)

    def _admit(self) -> None:
        group = self._take_waiting()
        if not group:
            return
        self._admitting = group
        try:
            self._prefill(group)
        finally:
            self._admitting = []

    def _prefill(self, group: list[_Sequence]) -> None:
        """Prefill ``group`` together and merge it into the running batch."""
        inputs = prefill_inputs([s.request.input_ids for s in group], self.device)
        cache = new_cache(self.model)
        try:
            out = self.model(**inputs, **{self._cache_kw: cache}, use_cache=True)
        except Exception as e:
            if len(group) == 1:
                self._fail(group[0], e, "prefill")
                return
            # one prompt may be what breaks the pass: give each its own
            logger.warning("prefill of %d requests failed (%s); retrying one by one", len(group), e)
            for seq in group:
                self._prefill([seq])
            return
        tokens, logprobs, failed = self._sample(out.logits[:, -1], group)
        keep = self._record(group, tokens, logprobs, failed)
        self.stats["prefill_tokens"] += int(inputs["attention_mask"].sum())
        if keep:
            staged = RunningBatch()
            staged.merge(cache, inputs["attention_mask"], tokens)
            staged.keep(keep)
            self._batch.merge(staged.cache, staged.mask, staged.next_tokens)
            self._running.extend(group[i] for i in keep)

    def _decode(self) -> None:
        out = self.model(
            **self._batch.decode_inputs(), **{self._cache_kw: self._batch.cache}, use_cache=True
        )
        tokens, logprobs, failed = self._sample(out.logits[:, -1], self._running)
        self._batch.advance(tokens)
        keep = self._record(self._running, tokens, logprobs, failed)
        self._running = [self._running[i] for i in keep]
        self._batch.keep(keep)
        self.stats["decode_steps"] += 1

    def _sample(
        self, logits: torch.Tensor, seqs: list[_Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, Exception]]:
        """Sample every row; returns tokens, log-probs and the rows that failed (by index).

        When the batch cannot be sampled, each row is sampled on its own, so a row that
        breaks sampling fails alone (failed rows get token 0, and are dropped).
        """
        try:
            tokens, logprobs = self._sample_rows(logits, seqs)
            return tokens, logprobs, {}
        except Exception as e:
            logger.warning("sampling a batch of %d failed (%s); sampling rows alone", len(seqs), e)
        tokens = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
        logprobs = torch.zeros(len(seqs), dtype=torch.float32, device=logits.device)
        failed: dict[int, Exception] = {}
        for i, seq in enumerate(seqs):
            try:
                token, logprob = self._sample_rows(logits[i : i + 1], [seq])
            except Exception as e:
                failed[i] = e
                continue
            tokens[i], logprobs[i] = token[0], logprob[0]
        return tokens, logprobs, failed

    def _sample_rows(
        self, logits: torch.Tensor, seqs: list[_Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_tokens(
            logits,
            [s.request.params for s in seqs],
            [s.output_ids for s in seqs],
            [s.stop_ids for s in seqs],
            [s.generator for s in seqs],
        )

    def _record(
        self,
        seqs: list[_Sequence],
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        failed: dict[int, Exception],
    ) -> list[int]:
        """Append each row's new token; finish rows that stop or failed. Returns rows still
        running."""
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()
        now = time.perf_counter()
        keep = []
        for i, seq in enumerate(seqs):
            if i in failed:
                self._fail(seq, failed[i], "sampling")
                continue
            seq.output_ids.append(token_list[i])
            seq.output_logprobs.append(logprob_list[i])
            seq.first_token = seq.first_token or now
            self.stats["generated_tokens"] += 1
            try:
                finish = self._finish_reason(seq)
            except Exception as e:  # e.g. decoding this row's tail for stop strings
                self._fail(seq, e, "stop check")
                continue
            if finish is None:
                keep.append(i)
            else:
                self._resolve(seq, finish)
        return keep

    def _fail(self, seq: _Sequence, error: Exception, stage: str) -> None:
        """Fail one request, leaving the rest of its batch running."""
        logger.warning("request %s failed in %s: %s", seq.request.rid, stage, error)
        self.stats["failed_requests"] += 1
        failure = SequenceError(f"generation failed in {stage}: {error}")
        failure.__cause__ = error
        settle(seq.future, error=failure)

    def _finish_reason(self, seq: _Sequence) -> dict[str, Any] | None:
        token = seq.output_ids[-1]
        params = seq.request.params
        if token in seq.stop_ids and len(seq.output_ids) >= params.min_new_tokens:
            return {"type": "stop", "matched": token}
        if params.stop:
            tail = self.tokenizer.decode(seq.output_ids[-16:], skip_special_tokens=False)
            for text in params.stop:
                if text and text in tail:
                    return {"type": "stop", "matched": text}
        if len(seq.output_ids) >= seq.max_new_tokens:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _resolve(self, seq: _Sequence, finish: dict[str, Any]) -> None:
        now = time.perf_counter()
        result = GenerationResult(
            rid=seq.request.rid,
            prompt_tokens=len(seq.request.input_ids),
            output_ids=list(seq.output_ids),
            output_logprobs=list(seq.output_logprobs),
            finish_reason=finish,
            latency=now - seq.created,
            ttft=None if seq.first_token is None else seq.first_token - seq.created,
        )
        settle(seq.future, result)

    def _abort_all(self, message: str, include_waiting: bool, rid: str | None = None) -> int:
        aborted = 0
        keep = []
        for i, seq in enumerate(self._running):
            if rid is None or seq.request.rid == rid:
                self._resolve(seq, {"type": "abort", "message": message})
                aborted += 1
            else:
                keep.append(i)
        self._running = [self._running[i] for i in keep]
        self._batch.keep(keep)
        if include_waiting:
            with self._lock:
                waiting = list(self._waiting)
                self._waiting = collections.deque(
                    s for s in waiting if rid is not None and s.request.rid != rid
                )
            for seq in waiting:
                if rid is None or seq.request.rid == rid:
                    self._resolve(seq, {"type": "abort", "message": ABORT_BEFORE_PREFILL})
                    aborted += 1
        return aborted

    def _fail_running(self, error: Exception) -> None:
        for seq in [*self._running, *self._admitting]:
            settle(seq.future, error=error)
        self._running = []
        self._admitting = []
        self._batch.clear()

    # --- commands (run on the engine thread) ---

    def _cmd_pause(self, mode: str = "abort") -> dict[str, Any]:
        aborted = (
            0
            if mode == "in_place"
            else self._abort_all(
                "Abort in-flight requests (generation paused)", include_waiting=True
            )
        )
        self._paused = True
        return {"success": True, "aborted": aborted}

    def _cmd_continue(self) -> dict[str, Any]:
        self._paused = False
        return {"success": True}

    def _cmd_abort(self, rid: str | None = None) -> dict[str, Any]:
        return {"success": True, "aborted": self._abort_all("Aborted by request", True, rid)}

    def _cmd_release(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Give the accelerator memory back (SGLang requires an idle server for it)."""
        if self._running:
            raise RequestError(
                f"release_memory_occupation needs an idle server ({len(self._running)} "
                "requests running); pause generation first"
            )
        if self.device.type == "cuda" and not self._released:
            self.model.to("cpu")
            self._forget_weight_targets()
            torch.cuda.empty_cache()
        self._released = True
        self.stats["memory_releases"] += 1
        return {"success": True}

    def _cmd_resume(self, tags: list[str] | None = None) -> dict[str, Any]:
        if self.device.type == "cuda" and self._released:
            self.model.to(self.device)
            self._forget_weight_targets()
        self._released = False
        self.stats["memory_resumes"] += 1
        return {"success": True}

    def stalled_for(self) -> float | None:
        """Seconds since the generation loop last turned; None while it is healthy.

        The loop turns at least every 0.1 s when idle and once per decode step; a dead
        thread, or a step or command stuck far longer than any step takes, is a frozen
        server (its health check then fails, as SGLang's does).
        """
        if not self._thread.is_alive():
            return float("inf")
        age = time.monotonic() - self._heartbeat
        return age if age > STALL_SECONDS else None

    @property
    def memory_released(self) -> bool:
        return self._released
