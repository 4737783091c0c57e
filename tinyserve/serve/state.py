"""What every handler shares: the server's configuration (`ServerConfig`, the fields of `tinyserve
run`'s flags) and its state (`ServerState`, one per app, under `STATE`): the engine, the model's
facts for validation, metrics, requests in flight, admission (429 / 503), stored responses.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.model.config import sampling_defaults
from tinyserve.model.tokenizer import Tokenizer
from tinyserve.serve.errors import APIError, bad
from tinyserve.serve.flight import Flight
from tinyserve.serve.metrics import ServerMetrics
from tinyserve.serve.protocol import ModelInfo
from tinyserve.serve.reasoning import PARSERS
from tinyserve.serve.response_store import ResponseStore

log = logging.getLogger("tinyserve.serve.server")


@dataclass(slots=True)
class ServerConfig:
    served_model_name: tuple[str, ...] = ()  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required on every route but /health when set
    allowed_origin: tuple[str, ...] = ()  # CORS is off unless origins are listed
    max_waiting: int = 1024  # requests without their first token yet; more get 429
    request_timeout: float | None = None  # seconds from arrival; None = no deadline
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish after SIGTERM
    clamp_max_tokens: bool = False  # shrink max_tokens to fit the context instead of a 400
    max_body_bytes: int = 1 << 20
    # Host header names served besides local ones (DNS rebinding guard): exact names,
    # ".example.com" for it and its subdomains, "*" for any.
    allowed_host: tuple[str, ...] = ()
    # Seconds a client has to send a request's headers, from the connect or its previous
    # response (slowloris); an idle keep-alive connection is closed after it too.
    header_timeout: float = 10.0
    # Defaults for the sampling fields a request leaves unset (temperature, top_p, top_k, min_p,
    # repetition_penalty; max_new_tokens caps an unset max_tokens), vLLM's: "auto" from the
    # model's generation_config.json, "vllm" none, or a directory holding such a file.
    generation_config: str = "auto"
    web_ui: bool = True  # the chat page at / (serve/web_ui.py)
    # How a thinking model's reasoning is split from its answer (serve/reasoning.py): "qwen3",
    # "deepseek_r1", or None (the text is all answer).
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        self.served_model_name = tuple(self.served_model_name)
        self.allowed_origin = tuple(self.allowed_origin)
        self.allowed_host = tuple(h.strip().lower() for h in self.allowed_host)
        if "*" in self.allowed_origin:
            raise ValueError("allowed_origin: list origins explicitly ('*' is not allowed)")
        if not all(self.allowed_host):
            raise ValueError("allowed_host: names must be non-empty")
        special = ("auto", "vllm")
        if self.generation_config not in special and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"generation_config: 'auto', 'vllm' or a directory, got {self.generation_config!r}"
            )
        if self.reasoning_parser not in (None, *PARSERS):
            raise ValueError(
                f"reasoning_parser: one of {', '.join(PARSERS)}, got {self.reasoning_parser!r}"
            )
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout: must be > 0, got {self.header_timeout}")
        for name, low in [
            ("max_waiting", 1),
            ("max_body_bytes", 1),
            ("port", 0),
            ("request_timeout", 0),
            ("shutdown_timeout", 0),
        ]:
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")


def generation_defaults(config: ServerConfig, model: str) -> dict[str, Any]:
    """The request defaults `generation_config` names: the generation_config.json of the model
    ("auto"), of another directory, or none ("vllm"); ValueError for a file with bad values."""
    if config.generation_config == "vllm":
        return {}
    source = model if config.generation_config == "auto" else config.generation_config
    return sampling_defaults(source)


def served_names(config: ServerConfig, model: str) -> tuple[str, ...]:
    """The names clients may send; the first is reported (default: the model directory's)."""
    return config.served_model_name or (model.rstrip("/").rsplit("/", 1)[-1],)


class ServerState:
    """Everything the handlers share (one per app)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        llm = engine.engine
        self.engine, self.config, self.tokenizer = engine, config, llm.tokenizer
        model = self.model_path = llm.config.model
        self.served = served_names(config, model)
        vocab = self.tokenizer.backend.get_vocab() if self.tokenizer else {}
        longest = max(map(len, vocab), default=1)
        defaults = generation_defaults(config, model)
        if defaults:
            log.info("default sampling params (--generation-config): %s", defaults)
        self.info = ModelInfo(
            self.served + (model,),
            llm.max_model_len,
            llm.model_config.vocab_size,
            max(1, longest),
            defaults,
        )
        self.metrics = ServerMetrics(llm, self.served[0])
        self.flights: set[Flight] = set()
        self.num_waiting = 0  # engine requests without their first output yet (backpressure)
        self.draining = False
        self.created = int(time.time())
        self.store = ResponseStore()  # /v1/responses kept for previous_response_id

    def require_tokenizer(self, param: str) -> Tokenizer:
        """Checkpoints without tokenizer.json (dummy benchmark shapes) serve token ids only."""
        if self.tokenizer is None:
            raise bad(param, "this model has no tokenizer: send token ids as the prompt")
        return self.tokenizer

    def check_admission(self, num_requests: int) -> None:
        if not self.engine.is_running:
            raise APIError(
                503,
                "The engine stopped after an error; the server is restarting.",
                type="server_error",
                code="engine_dead",
            )
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down.",
                type="server_error",
                code="shutting_down",
                headers={"Connection": "close"},
            )
        if self.num_waiting + num_requests > self.config.max_waiting:
            raise APIError(
                429,
                f"Too many requests are waiting ({self.num_waiting}); retry later.",
                type="rate_limit_error",
                code="server_busy",
                headers={"Retry-After": "1"},
            )


STATE = web.AppKey("state", ServerState)
