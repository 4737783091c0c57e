"""`tinyserve` command line: generate (stream one completion to stdout) and convert (GGUF -> HF)."""

from __future__ import annotations

import sys

import click

from tinyserve.sampling import InvalidParameter


@click.group()
def main() -> None:
    """tinyserve: a compact LLM inference server."""


def engine_options(f):
    """Engine flags shared by the commands that load a model (names map 1:1 onto EngineConfig)."""
    opts = [
        click.option("--model", default=None, help="HF model directory (default: SmolLM2-135M)."),
        click.option("--dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "float32", "bfloat16", "float16"])),
        click.option("--max-model-len", type=int, default=None),
        click.option("--max-num-seqs", type=int, default=256, show_default=True),
        click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--num-kv-blocks", type=int, default=None, help="Override KV pool size."),
        click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True),
        click.option("--load-format", default="auto", show_default=True,
                     type=click.Choice(["auto", "dummy"])),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", default=None, help="cuda or cpu (default: cuda if available)."),
    ]  # fmt: skip
    for opt in reversed(opts):
        f = opt(f)
    return f


ENGINE_KEYS = (
    "model dtype max_model_len max_num_seqs max_num_batched_tokens block_size num_kv_blocks "
    "gpu_memory_utilization load_format seed device"
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
    from tinyserve.engine import LLMEngine
    from tinyserve.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        engine = LLMEngine(EngineConfig(**{k: kwargs[k] for k in ENGINE_KEYS}))
        tok = engine.tokenizer
        ids = (
            tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]),
                       add_special_tokens=False)
            if chat else prompt
        )  # fmt: skip
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
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def convert(gguf_file: str, out_dir: str) -> None:
    """Convert a GGUF file into a Hugging Face directory (config, safetensors, tokenizer)."""
    from tinyserve.gguf import convert_gguf

    click.echo(convert_gguf(gguf_file, out_dir))


if __name__ == "__main__":
    main()
