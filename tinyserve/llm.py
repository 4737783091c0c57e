"""Offline API with vLLM's shapes: `LLM(model).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm import tqdm

from tinyserve.config import EngineConfig
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.outputs import RequestOutput
from tinyserve.sampling_params import SamplingParams

Prompt = str | list[int]  # or a 1-D numpy array or tensor of ids
Message = dict[str, str]


def _is_one_prompt(prompts) -> bool:
    """Text, a list of ids, or a 1-D array or tensor of ids (a 2-D one is a batch of rows)."""
    if isinstance(prompts, str):
        return True
    if hasattr(prompts, "ndim"):  # numpy, torch
        return prompts.ndim == 1
    return bool(prompts) and isinstance(prompts[0], int)


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
            )
        results: dict[str, RequestOutput] = {}
        order = []
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm)
        try:
            # A structured-outputs spec compiles in add_request (once per distinct spec: the
            # engine caches them); an invalid one raises InvalidParameter.
            for prompt, params in zip(prompts, sampling_params):
                rid = str(self._counter)
                self._counter += 1
                self.engine.add_request(rid, prompt, params)
                order.append(rid)
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    out = results.get(delta.request_id)
                    if out is None:
                        out = results[delta.request_id] = RequestOutput(
                            delta.request_id, delta.prompt, delta.prompt_token_ids, []
                        )
                    out.merge(delta)
                    if out.finished:
                        bar.update(1)
        except BaseException:
            for rid in order:  # leave the engine clean for the next call (e.g. Ctrl-C)
                self.engine.abort(rid)
            self.engine.step()
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                add_special_tokens=False,
            )
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)
