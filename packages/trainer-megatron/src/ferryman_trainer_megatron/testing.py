"""``FakeMegatronRuntime``: a stand-in for Megatron-core on CPU, for the tests of the backend's
plumbing (micro-batches, weighting, losses from ``ferryman.algorithms``, metrics, checkpoints).

Megatron has no CPU path, so this fake runs a transformers model of the same checkpoint in one
process and hands the backend what Megatron's last pipeline stage would: logits of a *padded*
vocabulary (the padded columns hold large junk values, so a padding mask that did not work
would change every log-prob) for the actor and reference, a ``[b, t]`` value for the critic
(transformers' token-classification head). Optimizer: torch AdamW with the config's settings and
global-norm clipping. It is not Megatron: the real runtime is
:class:`ferryman_trainer_megatron.megatron_runtime.MegatronRuntime`, tested on GPUs.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from ferryman.batch import TrainBatch
from ferryman_trainer_megatron.config import MegatronTrainerConfig
from ferryman_trainer_megatron.mapping import padded_vocab_size
from ferryman_trainer_megatron.trainer import Head, LogitsShard

__all__ = ["ACTOR_METRICS", "CRITIC_METRICS", "FakeMegatronRuntime"]

ACTOR_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/lr")
"""What the backend's ``update_actor`` returns, whatever the runtime (for ``TrainerContract.ACTOR_METRICS``)."""
CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm")
"""What its ``update_critic`` returns (for ``TrainerContract.CRITIC_METRICS``)."""


class _Handle:
    def __init__(self, role: str, model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> None:
        self.role = role
        self.model = model
        self.optim = optim


class FakeMegatronRuntime:
    """One process, data-parallel size 1, the reporting rank (see the module docstring)."""

    dp_rank = 0
    dp_size = 1
    reporter = True
    PAD_JUNK = 30.0
    """Logit of every padded vocabulary column (far above the real ones)."""

    def __init__(self, config: MegatronTrainerConfig, *, model_path: str, seed: int = 0) -> None:
        from transformers import AutoConfig

        self.config = config
        self.model_path = model_path
        torch.manual_seed(seed)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.padded_vocab = padded_vocab_size(self.vocab_size, config.make_vocab_size_divisible_by, config.tensor_parallel_size)
        self.runs = 0
        self.offloads = 0

    # ------------------------------------------------------------------ models
    def build(self, role: str) -> _Handle:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        if role == "critic":
            cfg = AutoConfig.from_pretrained(self.model_path, num_labels=1)
            cfg.classifier_dropout = 0.0
            model = AutoModelForTokenClassification.from_pretrained(self.model_path, config=cfg, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model.config.use_cache = False
        model.eval()
        optim = None
        if role == "ref":
            model.requires_grad_(False)
        else:
            c = self.config
            optim = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=c.lr if role == "actor" else c.critic_lr,
                betas=tuple(c.betas), eps=c.adam_eps, weight_decay=c.weight_decay,
            )
        return _Handle(role, model, optim)

    def run(self, handle: _Handle, micro_batches: list[TrainBatch], head: Head, forward_only: bool) -> list[dict[str, Any]]:
        self.runs += 1
        records = []
        handle.model.train(not forward_only)
        for sub in micro_batches:
            with torch.set_grad_enabled(not forward_only):
                out = handle.model(input_ids=sub.input_ids, attention_mask=sub.attention_mask,
                                   position_ids=sub.position_ids, use_cache=False).logits
                if handle.role == "critic":
                    given: Any = out[..., 0]
                else:
                    pad = out.new_full((*out.shape[:2], self.padded_vocab - self.vocab_size), self.PAD_JUNK)
                    given = LogitsShard(torch.cat([out, pad], dim=-1), 0, self.vocab_size, None)
                loss, rec = head(given, sub)
                if not forward_only:
                    loss.backward()
            records.append({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in rec.items()})
        handle.model.eval()
        return records

    def step(self, handle: _Handle, lr: float) -> float:
        assert handle.optim is not None
        for group in handle.optim.param_groups:
            group["lr"] = lr
        params = [p for p in handle.model.parameters() if p.requires_grad]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm).item())
        if math.isfinite(norm):
            handle.optim.step()
        handle.optim.zero_grad(set_to_none=True)
        return norm

    # ------------------------------------------------------------------ collectives (one rank)
    def world_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def dp_max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # ------------------------------------------------------------------ weights and state
    def iter_hf_weights(self, handle: _Handle, *, on_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, t in handle.model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            yield name, t.detach().contiguous() if on_device else t.detach().to("cpu", torch.float32, copy=True).contiguous()

    def save(self, handles: dict[str, _Handle], path: str, with_optim: dict[str, bool]) -> None:
        for role, h in handles.items():
            state = {"model": {k: v.clone() for k, v in h.model.state_dict().items()}}
            if with_optim[role] and h.optim is not None:
                state["optim"] = h.optim.state_dict()
            torch.save(state, os.path.join(path, f"fake_{role}.pt"))

    def load(self, handles: dict[str, _Handle], path: str, with_optim: dict[str, bool]) -> None:
        for role, h in handles.items():
            state = torch.load(os.path.join(path, f"fake_{role}.pt"), weights_only=False)
            h.model.load_state_dict(state["model"])
            if h.optim is not None:
                if with_optim[role]:
                    h.optim.load_state_dict(state["optim"])
                else:
                    h.optim.state.clear()

    def save_extra(self, path: str, extra: dict[str, Any]) -> None:
        torch.save(extra, os.path.join(path, "extra.pt"))

    def load_extra(self, path: str) -> dict[str, Any] | None:
        p = os.path.join(path, "extra.pt")
        return torch.load(p, weights_only=False) if os.path.isfile(p) else None

    def shared_tempdir(self) -> str:
        return tempfile.mkdtemp(prefix="ferryman-fake-megatron-")

    def rng_state(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])

    def offload(self, handles: dict[str, _Handle]) -> None:
        self.offloads += 1  # everything already lives in host memory

    def onload(self, handles: dict[str, _Handle]) -> None:
        pass

    def close(self) -> None:
        pass
