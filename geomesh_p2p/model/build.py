"""Building a Hugging Face causal LM from a configuration, and the flat view of its weights.

Models are always built from a configuration (:data:`PRESETS` or a JSON file), never
downloaded: ``from_pretrained`` is not used anywhere. Weights travel between peers as one
flat fp32 CPU vector (:func:`flat_params` / :func:`load_flat_`). ``transformers`` is imported on
first use (it takes seconds).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from geomesh_p2p.config.flags import file_value_problem
from geomesh_p2p.model.presets import PRESETS

__all__ = [
    "PRESETS",
    "ConfigError",
    "build_model",
    "model_config",
    "flat_params",
    "pseudo_gradient",
    "load_flat_",
    "num_params",
    "count_params",
]


class ConfigError(ValueError):
    """Unknown preset, unreadable/unparsable model config file, or an invalid config.

    The message is one line and names the preset or file.
    """


def _read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"model config file not found: {p}")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"model config file {p} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read model config file {p}: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"model config file {p} must hold a JSON object")
    return d


def _preset_kinds() -> dict[str, str]:
    """The value kind (:func:`geomesh_p2p.config.flags.file_value_problem`'s) of each key a preset sets: ``int``,
    ``number`` (a float of a preset), ``text``; ``bool`` for a switch."""
    out: dict[str, str] = {}
    for preset in PRESETS.values():
        for k, v in preset.items():
            if isinstance(v, bool):  # before int: a bool is an int to Python
                out[k] = "bool"
            elif isinstance(v, int):
                out[k] = "int"
            else:
                out[k] = "number" if isinstance(v, float) else "text"
    return out


def _check_value_types(d: dict[str, Any], source: str) -> None:
    """Refuse a value of ``d`` (a model config file's) whose type is not that of the same key in the presets
    (``"n_layer": true`` was a 1-layer model, ``"n_embd": [128]`` a traceback in transformers); null passes (a
    Hugging Face config's unset token id). Raises ConfigError naming ``source`` and the key."""
    kinds = _preset_kinds()
    for key, value in d.items():
        kind = kinds.get(key)
        if kind is None or value is None:
            continue
        if kind == "bool":
            problem = None if isinstance(value, bool) else f"expected true or false, got {value!r}"
        else:
            problem = file_value_problem(kind, value)
        if problem is not None:
            raise ConfigError(f"{source}: {key}: {problem}")


def model_config(
    preset: str | None = "tiny", config_file: str | os.PathLike | None = None, vocab_size: int | None = None
):
    """The ``transformers.PretrainedConfig`` :func:`build_model` would use (no weights).

    ``config_file`` (JSON) wins over ``preset``. It is either a Hugging Face
    ``config.json`` (must contain ``"model_type"``, e.g. ``"gpt2"`` or ``"llama"``) or
    ``{"preset": "<name>", ...overrides}``. ``vocab_size`` overrides both. A GPT-2 config's
    ``"gelu_new"`` activation (its default) becomes ``"gelu_pytorch_tanh"``, the same function as one
    fused op, which keeps a quarter of the activation memory.

    Raises:
        ConfigError: unknown preset / model_type, missing or unparsable file, or a
            configuration the model class rejects.
    """
    from transformers import AutoConfig

    if config_file is not None:
        d = _read_config_file(config_file)
        source = f"model config file {Path(config_file).expanduser()}"
        _check_value_types(d, source)
        if "preset" in d:
            name = d.pop("preset")
            if name not in PRESETS:
                raise ConfigError(f"{source}: unknown preset {name!r} (known: {', '.join(PRESETS)})")
            d = {**PRESETS[name], **d}
    else:
        if preset not in PRESETS:
            raise ConfigError(f"unknown model preset {preset!r} (known: {', '.join(PRESETS)})")
        d = dict(PRESETS[preset])
        source = f"preset {preset!r}"
    model_type = d.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError(f'{source}: missing "model_type" (e.g. "gpt2", "llama") or "preset"')
    for k in ("architectures", "transformers_version", "_name_or_path", "auto_map"):
        d.pop(k, None)  # harmless in HF config.json, irrelevant here; auto_map = remote code
    if vocab_size is not None:
        d["vocab_size"] = int(vocab_size)
    d.setdefault("use_cache", False)
    if model_type == "gpt2" and d.get("activation_function", "gelu_new") == "gelu_new":
        # The same tanh-approximated GELU (within 5e-7), as one fused op: "gelu_new" is written in Python and
        # autograd keeps 4 tensors of [B, T, 4d] per layer for it instead of 1 (432 MiB at gpt2-124m, one
        # 1,024-token row: 0.2x the method's minimum; issue 27).
        d["activation_function"] = "gelu_pytorch_tanh"
    # Our tokenizers put <|endoftext|> at id 0; GPT-2's default 50256 is out of range
    # for a smaller vocabulary (and transformers warns about it).
    if model_type == "gpt2" and int(d.get("vocab_size", 50257)) <= 50256:
        d.setdefault("bos_token_id", 0)
        d.setdefault("eos_token_id", 0)
    for attr in ("bos_token_id", "eos_token_id"):
        v = d.get(attr)
        if isinstance(v, int) and "vocab_size" in d and v >= int(d["vocab_size"]):
            d[attr] = 0
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except Exception as e:
        raise ConfigError(
            f"{source}: invalid configuration ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return cfg


def build_model(
    preset: str | None = "tiny",
    config_file: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
):
    """A freshly initialised causal LM, fp32 on CPU, in train mode.

    Built with ``AutoModelForCausalLM.from_config`` (never ``from_pretrained``; nothing
    is downloaded). Initialisation draws from the global torch RNG inside
    ``torch.random.fork_rng`` seeded with ``seed``, so the same (config, seed, torch
    and transformers versions) give bitwise-identical weights and the caller's RNG
    state is untouched. Attention uses PyTorch SDPA.

    Raises:
        ConfigError: see :func:`model_config`; also when the model class rejects it.
    """
    from transformers import AutoModelForCausalLM

    cfg = model_config(preset, config_file, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        try:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        except Exception as e:
            src = f"model config file {config_file}" if config_file else f"preset {preset!r}"
            raise ConfigError(
                f"{src}: cannot build model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from None
    model = model.float()
    if getattr(model, "loss_type", "ForCausalLM") is None:
        # transformers 5 derives it from the class name; GPT2LMHeadModel matches nothing
        # and would log a warning on first use. Same loss either way.
        model.loss_type = "ForCausalLM"
    model.train()
    return model


def count_params(
    preset: str | None = "tiny", config_file: str | os.PathLike | None = None, vocab_size: int | None = None
) -> int:
    """Parameters :func:`build_model` would give (tied weights once), without allocating them.

    The model is built on PyTorch's ``meta`` device (shapes only: no memory, no initialisation),
    so even large presets are counted in milliseconds once transformers is imported. E.g.
    ``count_params("llama-150m", vocab_size=4096) == 153_641_984``.

    Raises:
        ConfigError: as :func:`model_config`.
    """
    from transformers import AutoModelForCausalLM

    cfg = model_config(preset, config_file, vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return num_params(model)


def num_params(model) -> int:
    """Number of elements of :func:`flat_params` (tied weights counted once)."""
    return sum(p.numel() for _, p in model.named_parameters())


def flat_params(model, out: torch.Tensor | None = None) -> torch.Tensor:
    """All trainable parameters as one new fp32 CPU tensor ``[P]``.

    Order: ``model.named_parameters()`` order, each tensor flattened row-major.
    ``named_parameters`` yields a shared tensor once, so tied weights (GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``) appear once, under the first name.
    Buffers (e.g. rotary caches) are not included. Always a copy.

    ``out``: an fp32 CPU tensor of ``P`` elements to write into (returned), parameter by parameter:
    no second ``[P]`` temporary (``torch.cat`` of per-parameter copies). Raises ``ValueError`` on a
    size mismatch.
    """
    if out is not None:
        flat = out.view(-1)
        if flat.numel() != num_params(model):
            raise ValueError(f"out has {flat.numel()} elements, the model has {num_params(model)}")
        off = 0
        with torch.no_grad():
            for _, p in model.named_parameters():
                n = p.numel()
                flat[off : off + n].copy_(p.detach().reshape(-1))
                off += n
        return out
    with torch.no_grad():
        parts = [p.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for _, p in model.named_parameters()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)


def pseudo_gradient(model, theta: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``theta - flat_params(model)``: the pseudo-gradient of a round's inner steps, fp32 CPU ``[P]``.

    Computed parameter by parameter into the one result tensor, so the peak is one ``[P]`` (the
    result) instead of two (the flattened copy and the difference). Bitwise equal to
    ``theta - flat_params(model)``. ``theta``: fp32 CPU ``[P]`` (layout of :func:`flat_params`).
    ``out``: fp32 CPU ``[P]`` written and returned (a buffer reused across rounds, issue 27: no fresh
    ``[P]`` to fault in); None allocates one. Raises ``ValueError`` on a size mismatch.
    """
    theta = theta.reshape(-1)
    total = num_params(model)
    if theta.numel() != total:
        raise ValueError(f"theta has {theta.numel()} elements, the model has {total}")
    if out is None:
        out = torch.empty(total, dtype=torch.float32)
    elif out.numel() != total or out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 CPU tensor of {total} elements")
    out = out.reshape(-1)
    off = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            n = p.numel()
            torch.sub(theta[off : off + n], p.detach().reshape(-1).to("cpu", torch.float32), out=out[off : off + n])
            off += n
    return out


def load_flat_(model, flat: torch.Tensor) -> None:
    """Copy a flat vector (layout of :func:`flat_params`) into the model's parameters.

    ``flat`` may be on any device and of any floating dtype; values are converted to
    each parameter's device and dtype. Raises ``ValueError`` on a size mismatch.
    """
    flat = flat.reshape(-1)
    total = num_params(model)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} elements, model has {total}")
    off = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            n = p.numel()
            p.copy_(flat[off : off + n].view_as(p))
            off += n
