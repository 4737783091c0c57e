"""`tinyserve` command line: run (the OpenAI-compatible server), generate (stream one completion
to stdout), token-map (a draft token map from text) and convert (GGUF -> HF)."""

from __future__ import annotations

import atexit
import gc
import json
import sys

import click

from tinyserve.sampling_params import InvalidParameter


@click.group()
def main() -> None:
    """tinyserve: a compact LLM inference server."""


def engine_options(f):
    """Engine flags shared by the commands that load a model (names map 1:1 onto EngineConfig)."""
    opts = [
        click.option("--model", default=None, help="HF model directory (default: SmolLM2-135M)."),
        click.option(
            "--dtype",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            help="Weights and KV dtype; auto follows the checkpoint and the device.",
        ),
        click.option(
            "--max-model-len",
            type=int,
            default=None,
            help="Context length (default: the model's, capped by the KV capacity).",
        ),
        click.option(
            "--max-num-seqs",
            type=int,
            default=256,
            show_default=True,
            help="Most sequences in one batch.",
        ),
        click.option(
            "--max-num-batched-tokens",
            type=int,
            default=8192,
            show_default=True,
            help="Token budget of one engine step (prefill chunks + decodes).",
        ),
        click.option(
            "--block-size",
            type=int,
            default=16,
            show_default=True,
            help="Tokens per KV block (a power of two).",
        ),
        click.option("--num-kv-blocks", type=int, default=None, help="Override KV pool size."),
        click.option(
            "--gpu-memory-utilization",
            type=float,
            default=0.9,
            show_default=True,
            help="Fraction of GPU memory for weights, activations and the KV cache.",
        ),
        click.option(
            "--load-format",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "dummy"]),
            help="auto: the checkpoint's safetensors; dummy: seeded random weights.",
        ),
        click.option(
            "--seed",
            type=int,
            default=0,
            show_default=True,
            help="Seed for requests that do not set one (and dummy weights).",
        ),
        click.option("--device", default=None, help="cuda or cpu (default: cuda if available)."),
        click.option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            default=True,
            show_default=True,
            help="Reuse the KV of committed prompt/answer prefixes.",
        ),
        click.option(
            "--prefix-cache-state-budget",
            type=int,
            default=None,
            help="Hybrid models (Qwen3.5): recurrent-state checkpoint rows kept for prefix "
            "hits, beside idle sequence slots, which hold checkpoints until a request takes "
            "them (default: max_num_seqs / 4; 0: idle slots only).",
        ),
        click.option(
            "--prefix-cache-decode-state-interval",
            type=int,
            default=4,
            show_default=True,
            help="Hybrid models: a decoding sequence saves its state at the end of the KV "
            "block its prompt ends in, then every this many blocks: where the next chat turn "
            "resumes (0: no decode saves).",
        ),
        click.option("--enforce-eager", is_flag=True, help="No CUDA graphs (debugging)."),
        click.option(
            "--async-scheduling/--no-async-scheduling",
            default=None,
            help="Overlap: launch step N+1 while step N's tokens are read back "
            "(default: on with CUDA, off on the CPU).",
        ),
        click.option(
            "--speculative-method",
            type=click.Choice(["mtp", "ngram"]),
            default=None,
            help="Speculative decoding: the checkpoint's MTP head, or prompt lookup.",
        ),
        click.option(
            "--num-speculative-tokens",
            type=int,
            default=None,
            help="Drafts per step (k); required with --speculative-method.",
        ),
        click.option(
            "--speculative-token-map",
            default=None,
            help="MTP: draft only the token ids in this JSON list (FR-Spec / "
            "SGLang's token map); cuts the draft's LM-head reads.",
        ),
        click.option(
            "--prefill-lane-tokens",
            type=int,
            default=None,
            help="While others decode, a long prompt's chunks of this many tokens run "
            "beside the steps on part of the GPU (default 4096 where it can; 0: "
            "off).",
        ),
        click.option(
            "--prefill-lane-reserve-sms",
            type=int,
            default=None,
            help="SMs the prefill lane leaves to decode steps (default: half, 3/8 for "
            "models of 4 GiB of weights or more).",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


ENGINE_KEYS = (
    "model dtype max_model_len max_num_seqs max_num_batched_tokens block_size num_kv_blocks "
    "gpu_memory_utilization load_format seed device enable_prefix_caching "
    "prefix_cache_state_budget prefix_cache_decode_state_interval enforce_eager "
    "async_scheduling speculative_method num_speculative_tokens speculative_token_map "
    "prefill_lane_tokens prefill_lane_reserve_sms"
).split()


@main.command()
@engine_options
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.argument("prompt")
def generate(prompt: str, chat: bool, max_tokens: int, temperature: float, **kwargs) -> None:
    """Stream one completion of PROMPT to stdout."""
    from tinyserve.config import EngineConfig
    from tinyserve.engine.llm_engine import LLMEngine
    from tinyserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        engine = LLMEngine(EngineConfig(**{k: kwargs[k] for k in ENGINE_KEYS}))
        tok = engine.tokenizer
        ids = (
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": prompt}]),
                add_special_tokens=False,
            )
            if chat
            else prompt
        )
        engine.add_request("cli", ids, params)
    except (InvalidParameter, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    while engine.has_unfinished():
        for delta in engine.step():
            for o in delta.outputs:
                sys.stdout.write(o.text)
                sys.stdout.flush()
    sys.stdout.write("\n")


@main.command()
@engine_options
@click.option(
    "--served-model-name",
    multiple=True,
    help="Model name(s) clients send and responses report (repeatable; default: the "
    "model directory's name).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port (0: any free one).")
@click.option(
    "--api-key",
    default=None,
    envvar="TINYSERVE_API_KEY",
    help="Require 'Authorization: Bearer KEY' on every route but /health [env: TINYSERVE_API_KEY].",
)
@click.option(
    "--allowed-origin",
    multiple=True,
    help="Origin allowed by CORS (repeatable; default: CORS off).",
)
@click.option(
    "--max-waiting",
    type=int,
    default=1024,
    show_default=True,
    help="Requests waiting for their first token; more get 429 + Retry-After.",
)
@click.option(
    "--request-timeout",
    type=float,
    default=None,
    help="Seconds a request may take from arrival (default: no limit).",
)
@click.option(
    "--shutdown-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="On SIGTERM/SIGINT: seconds in-flight requests get before they are aborted.",
)
@click.option(
    "--clamp-max-tokens",
    is_flag=True,
    help="Shrink max_tokens to fit the context instead of answering 400.",
)
@click.option(
    "--max-body-bytes",
    type=int,
    default=1 << 20,
    show_default=True,
    help="Largest request body accepted (413 above).",
)
@click.option(
    "--allowed-host",
    multiple=True,
    help="Host header name served besides localhost and IP addresses (repeatable; "
    "'.example.com' also allows its subdomains, '*' any name). Others get 400: a guard against "
    "DNS rebinding, by which a web page reaches a server on 127.0.0.1.",
)
@click.option(
    "--header-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds a client has to send a request's headers, counted from the connect or its "
    "previous response (slowloris); idle keep-alive connections close after it too.",
)
@click.option(
    "--generation-config",
    default="auto",
    show_default=True,
    help="Defaults for the sampling fields a request leaves unset (temperature, top_p, top_k, "
    "min_p, repetition_penalty; max_new_tokens caps an unset max_tokens), as vLLM: 'auto' from "
    "the model's generation_config.json, 'vllm' none, or a directory holding one.",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(["qwen3", "deepseek_r1"]),
    default=None,
    help="Split a thinking model's <think>...</think> reasoning from its answer: message."
    "reasoning in chat, reasoning items in /v1/responses, thinking blocks in /v1/messages "
    "(default: none, the text is all answer).",
)
@click.option(
    "--web-ui/--no-web-ui",
    default=True,
    show_default=True,
    help="Serve the chat page at / (it loads without the API key and asks for it).",
)
@click.option(
    "--debug-log",
    multiple=True,
    metavar="LOGGER",
    help="Log LOGGER at DEBUG level (repeatable), e.g. tinyserve.prefix: one line per prefix-"
    "cache match (tokens matched, where and why a hybrid model's match was clamped, tokens "
    "recomputed, the state checkpoint restored).",
)
def run(debug_log: tuple[str, ...], **kwargs) -> None:
    """Serve the chat page at / and the OpenAI-compatible API: /v1/chat/completions,
    /v1/completions, /v1/responses, Anthropic's /v1/messages, /v1/models, /health, /metrics,
    /tokenize, /detokenize, /version. POST bodies must be sent with 'Content-Type:
    application/json' (415 otherwise), so that no web page can post one without CORS."""
    import logging
    import urllib.parse

    import uvloop

    from tinyserve.config import EngineConfig
    from tinyserve.engine.async_engine import AsyncEngine
    from tinyserve.serve.server import ServerConfig, generation_defaults, serve, served_names
    from tinyserve.serve.web_ui import ui_url

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for name in debug_log:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        server_config = ServerConfig(**{k: v for k, v in kwargs.items() if k not in ENGINE_KEYS})
        engine = _load_engine(EngineConfig(**{k: kwargs[k] for k in ENGINE_KEYS}))
        generation_defaults(server_config, engine.config.model)  # a bad file fails here
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None

    def ready(url: str) -> None:
        name = served_names(server_config, engine.config.model)[0]
        pool = engine.pool
        click.echo(
            f"tinyserve: serving {name} at {url}/v1 (KV cache: "
            f"{engine.kv_capacity_tokens} tokens in {pool.num_blocks} blocks of "
            f"{pool.block_size}; max_model_len {engine.max_model_len}; "
            f"{engine.config.device}, {str(engine.dtype).removeprefix('torch.')})"
        )
        # Clients that tokenize themselves (lm-eval's tokenizer=, guidellm's --processor) load
        # the tokenizer from this Hugging Face directory.
        click.echo(f"tinyserve: model directory (HF tokenizer) {engine.config.model}")
        if server_config.web_ui:
            address = urllib.parse.urlsplit(url)
            click.echo(f"tinyserve: chat page at {ui_url(address.hostname, address.port)}")
        sys.stdout.flush()

    try:
        # The engine lives as long as this process: move everything built so far out of the
        # collector's generations, so the collections that per-step objects trigger stop
        # rescanning it (a CPU cProfile of 30 decode steps at 512 sequences spent ~75 ms in
        # collections triggered from per-step code; gc.freeze cut it to ~30 ms). Only here: an
        # `LLM` in a script may be dropped and rebuilt, and frozen cycles would never be freed.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # interpreter shutdown then collects it as usual
        code = uvloop.run(serve(AsyncEngine(engine), server_config, ready))
    except OSError as e:  # e.g. the port is taken
        raise click.ClickException(str(e)) from None
    sys.exit(code)


def _load_engine(config):
    """Build the engine in a thread while a progress line shows that loading is alive."""
    import concurrent.futures

    from tqdm import tqdm

    from tinyserve.engine.llm_engine import LLMEngine

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(LLMEngine, config)
        # NOTE: the loader reports no progress yet, so this shows elapsed time, not a fraction.
        with tqdm(desc="Loading weights", bar_format="{desc}: {elapsed}", file=sys.stderr) as bar:
            while not future.done():
                concurrent.futures.wait([future], timeout=0.2)
                bar.refresh()
    return future.result()


@main.command("token-map")
@click.option(
    "--model",
    default=None,
    help="HF directory whose tokenizer counts (default: the default model).",
)
@click.option(
    "--size",
    type=click.IntRange(min=1),
    default=32768,
    show_default=True,
    help="How many ids the map holds (at most the vocabulary).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    default="-",
    show_default=True,
    help="Where the JSON list goes (-: stdout).",
)
@click.argument("corpus", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def token_map(model: str | None, size: int, out: str, corpus: tuple[str, ...]) -> None:
    """Write a draft token map for --speculative-token-map: SIZE token ids, the special ones,
    then the most frequent of the CORPUS text files (UTF-8; text like the served traffic), then
    the lowest ids (a BPE vocabulary's most frequent merges)."""
    from tinyserve.model.tokenizer import Tokenizer
    from tinyserve.spec.token_map import build_token_map

    if model is None:
        from tinyserve.model.gguf import default_model_path

        model = default_model_path()
    try:
        tokenizer = Tokenizer.from_pretrained(model)
    except Exception as e:  # tokenizers raises a bare Exception for a missing or bad file
        raise click.ClickException(f"cannot load the tokenizer of {model}: {e}") from e

    def lines():
        for path in corpus:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from f

    ids = build_token_map(tokenizer, lines(), size)
    with click.open_file(out, "w") as f:
        json.dump(ids, f)
        f.write("\n")
    click.echo(f"{len(ids)} token ids -> {out}", err=True)


@main.command()
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def convert(gguf_file: str, out_dir: str) -> None:
    """Convert a GGUF file into a Hugging Face directory (config, safetensors, tokenizer)."""
    from tinyserve.model.gguf import convert_gguf

    click.echo(convert_gguf(gguf_file, out_dir))


if __name__ == "__main__":
    main()
