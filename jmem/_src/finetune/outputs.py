"""What a run writes besides its checkpoints: greedy samples, the adapters in PEFT format
and (``--export-merged``) the merged model as a Hugging Face checkpoint (full fine-tuning:
the trained params, and no adapters)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jmem import data as jdata
from jmem import qlora
from jmem._src.cli import one_line
from jmem._src.cli import user_input
from jmem._src.finetune.rundir import is_writer
from jmem.models import hf
from jmem.models import llama


class Sampler:
    """``--sample-prompt``: the greedy continuation under the current adapters (NF4 base and
    adapters through ``jmem.qlora.apply``, as in training; ``jmem.models.llama.generate``).

    On chat data (``chat``: the data set's ``report["chat"]``, every example a
    conversation) the prompt is a user turn rendered with the generation prompt by the
    tokenizer's chat template (``prompt_text``), as the model saw its training prompts, and
    the answer is cut at the end-of-turn ``eos_token``; on other data it is the raw text.
    ``tokens[when]`` holds each sample's ids (prompt and continuation, int32 ``[P + n]``).
    """

    def __init__(self, config, cfg, tok, step, chat: bool = False):
        self.config, self.cfg, self.tok, self.step = config, cfg, tok, step
        self.chat = chat
        self.rendered = prompt_text(config.output.sample_prompt, tok, chat)
        ids = tok.encode_with_offsets(self.rendered)[0] if chat else tok.encode(self.rendered)
        self.prompt = jnp.asarray(ids, jnp.int32)[None]
        self.texts, self.tokens = {}, {}

    def __call__(self, state, when: str) -> str:
        adapters = state.params
        if self.step.precision is not None:
            adapters = self.step.precision.cast_to_compute(adapters)
        full = state.frozen is None  # full fine-tuning: the params are the model
        out = llama.generate(
            adapters if full else state.frozen,
            self.prompt,
            self.cfg,
            max_new_tokens=self.config.output.sample_tokens,
            adapters=None if full else adapters,
            apply=None if full else qlora.apply,
        )
        self.tokens[when] = np.asarray(out[0])
        text = self.tok.decode(self.tokens[when][self.prompt.shape[1] :])
        eos = getattr(self.tok, "eos_token", None)
        if self.chat and eos and eos in text:  # the end of the assistant's turn
            text = text[: text.index(eos)]
        self.texts[when] = text
        how = " (chat template)" if self.chat else ""
        print(f"sample {when}{how}: {self.config.output.sample_prompt!r} -> {text!r}", flush=True)
        return text

    def record(self) -> dict:
        """What ``summary.json`` records: ``samples`` (the texts by when) and
        ``sample_prompt`` (the prompt as given, as rendered for the model, and which)."""
        form = "chat template, user turn" if self.chat else "raw text"
        prompt = {"text": self.config.output.sample_prompt, "rendered": self.rendered}
        return {"samples": self.texts, "sample_prompt": {**prompt, "form": form}}


def prompt_text(prompt: str, tok, chat: bool) -> str:
    """``--sample-prompt`` as the model is to see it: on chat data, one user turn followed by
    the generation prompt, rendered by the tokenizer's chat template
    (``jmem.data.render_prompt``, the plain template when it has none); else ``prompt``."""
    return jdata.render_prompt(prompt, tok) if chat else prompt


def save_adapters(config, cfg, state, paths) -> None:
    """The adapters in PEFT format, for ``--out/adapter``; with ``--export-merged``, the
    merged model as a self-contained Hugging Face checkpoint (written tensor by tensor,
    ``jmem.models.hf.save_params``: ``--checkpoint``'s token ids, generation config and
    tokenizer files carried over). Both are written into the staging areas of ``paths``
    (``jmem._src.finetune.publish.RunPaths``: ``--out/.staging/adapter`` and
    ``<--export-merged>.jmem-staging``), which the job renames into place once the run has
    succeeded (``publish``): a kill while they are written leaves the earlier ones whole."""
    full = state.frozen is None  # full fine-tuning: the params are the model, no adapters
    merged = config.output.export_merged
    params = _host_values(state.params) if merged or not full else None
    frozen = _host_values(state.frozen) if merged and not full else None
    if not is_writer():
        return
    os.makedirs(paths.staging, exist_ok=True)
    if full:
        print(
            "note: full fine-tuning (--lora-rank 0) trains no adapters: no PEFT adapter is "
            "written; --export-merged DIR writes the trained model",
            flush=True,
        )
    else:
        _save_peft(config, cfg, params, paths)
    if merged:
        with user_input(f"--export-merged {merged}"):
            hf.save_params(
                paths.merged_staging,
                params if full else frozen,
                cfg,
                adapters=None if full else params,
                source=config.model.checkpoint,
                tokenizer=_tokenizer_dir(config.model.tokenizer),
            )
        print(f"merged checkpoint (Hugging Face format): {merged}", flush=True)


def _save_peft(config, cfg, adapters, paths) -> None:
    """The adapters in PEFT format into ``--out/.staging/adapter`` (a note when PEFT cannot
    hold them)."""
    base = os.path.abspath(config.model.checkpoint) if config.model.checkpoint else None
    try:
        hf.save_adapters(
            os.path.join(paths.staging, "adapter"), adapters, cfg, base_model_name_or_path=base
        )
        print(f"adapters (PEFT format): {os.path.join(config.run.out, 'adapter')}", flush=True)
    except ValueError as e:  # e.g. targets PEFT's Llama has no module for (embeddings)
        print(f"note: adapters not written in PEFT format: {one_line(e)}", flush=True)


def _tokenizer_dir(tokenizer: str | None) -> str | None:
    """``--tokenizer`` as the directory the export copies the tokenizer from (None for
    ``byte``, which has no files)."""
    return tokenizer if tokenizer and os.path.isdir(tokenizer) else None


def _host_values(tree):
    """``tree`` with every array readable on this process: across processes the shards are
    gathered (a collective: every process calls it); on one process, as it is."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.process_allgather(tree, tiled=True)
