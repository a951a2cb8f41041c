"""The workaround for megatron-core 0.19.2's ``KeyError: 'step'`` when a distributed-optimizer
checkpoint is loaded with torch's AdamW (no Apex/TE), against Megatron's own method.

``DistributedOptimizer`` refuses CPU parameters, so the test calls the real
``DistributedOptimizer._set_main_param_and_optimizer_states`` on a stand-in ``self`` holding just
what that method reads (the parameter-to-group map, the config flag, a real torch AdamW after
one step), with the tensors ``load_parameter_state_from_fully_reshardable`` passes: ``param``,
``exp_avg``, ``exp_avg_sq`` and no ``step``."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra 'megatron')")

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

from ferryman_trainer_megatron.megatron_runtime import tolerate_torch_adam_step, untie_adam_steps  # noqa: E402


def _stand_in():
    model_param = torch.nn.Parameter(torch.zeros(4))
    main = torch.nn.Parameter(torch.ones(4))
    adam = torch.optim.AdamW([main], lr=0.1)
    main.grad = torch.ones(4)
    adam.step()  # state: step (a tensor), exp_avg, exp_avg_sq
    o = types.SimpleNamespace(
        model_param_group_index_map={model_param: (0, 0)},
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=adam,
    )
    o._set_main_param_and_optimizer_states = types.MethodType(DistributedOptimizer._set_main_param_and_optimizer_states, o)
    loaded = {"param": torch.full((4,), 7.0), "exp_avg": torch.full((4,), 0.5), "exp_avg_sq": torch.full((4,), 0.25)}
    return o, model_param, main, adam, loaded


def test_megatron_alone_fails_on_the_missing_step():
    o, model_param, _, _, loaded = _stand_in()
    with pytest.raises(KeyError, match="step"), torch.no_grad():  # Megatron loads under no_grad
        o._set_main_param_and_optimizer_states(model_param, loaded)


def test_the_wrapped_method_loads_every_state_and_keeps_the_restored_step():
    o, model_param, main, adam, loaded = _stand_in()
    adam.state[main]["step"].fill_(5.0)  # what load_state_dict restored from the param groups
    tolerate_torch_adam_step(o)
    tolerate_torch_adam_step(o)  # twice: wrapped once
    with torch.no_grad():
        o._set_main_param_and_optimizer_states(model_param, loaded)
    state = adam.state[main]
    assert torch.equal(main.detach(), loaded["param"])
    assert torch.equal(state["exp_avg"], loaded["exp_avg"]) and torch.equal(state["exp_avg_sq"], loaded["exp_avg_sq"])
    assert float(state["step"]) == 5.0
    # another missing state is still an error
    with pytest.raises(KeyError, match="exp_avg_sq"), torch.no_grad():
        o._set_main_param_and_optimizer_states(model_param, {"param": loaded["param"], "exp_avg": loaded["exp_avg"]})


def test_chained_optimizers_are_each_wrapped():
    a, pa, *_, la = _stand_in()
    b, pb, *_, lb = _stand_in()
    tolerate_torch_adam_step(types.SimpleNamespace(chained_optimizers=[a, b]))
    with torch.no_grad():
        a._set_main_param_and_optimizer_states(pa, la)
        b._set_main_param_and_optimizer_states(pb, lb)
    assert float(a.optimizer.state[a.optimizer.param_groups[0]["params"][0]]["step"]) == 1.0


def _restore_like_megatron(adam: torch.optim.AdamW, step_value: float) -> None:
    """What DistributedOptimizer.load_state_dict does without Apex/TE (megatron-core 0.19.2,
    distrib_optimizer.py, "Extract 'step', for non-Apex/TE support"): one step tensor for every
    parameter's state, then torch's load_state_dict."""
    inner = adam.state_dict()
    step = torch.tensor(step_value, dtype=torch.float)
    for s in inner["state"].values():
        s["step"] = step
    adam.load_state_dict(inner)


def _adam_after(steps: int) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    adam = torch.optim.AdamW(params, lr=0.1, foreach=True)
    for i in range(steps):
        for j, p in enumerate(params):
            p.grad = torch.full((5,), 0.1 * (i + j + 1))
        adam.step()
    return params, adam


def test_a_restored_step_is_one_tensor_for_all_parameters_until_untied():
    params, adam = _adam_after(1)
    _restore_like_megatron(adam, 1.0)
    steps = [adam.state[p]["step"] for p in params]
    assert all(s is steps[0] for s in steps)  # the shared tensor Megatron hands to torch
    for p in params:
        p.grad = torch.ones(5)
    adam.step()
    assert float(adam.state[params[0]]["step"]) == 1.0 + len(params)  # one increment per parameter

    params, adam = _adam_after(1)
    reference = [p.detach().clone() for p in params]
    ref_params, ref_adam = _adam_after(1)
    _restore_like_megatron(adam, 1.0)
    untie_adam_steps(adam)
    steps = [adam.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == len(params)
    for p, q in zip(params, ref_params):
        p.grad = torch.ones(5)
        q.grad = torch.ones(5)
    adam.step()
    ref_adam.step()
    for p, q, r in zip(params, ref_params, reference):
        assert float(adam.state[p]["step"]) == 2.0
        assert not torch.equal(p.detach(), r)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)  # the uninterrupted update, bit for bit


def test_the_wrapped_load_state_dict_unties_the_steps():
    params, adam = _adam_after(1)
    o = types.SimpleNamespace(optimizer=adam, _set_main_param_and_optimizer_states=lambda *a: None,
                              load_state_dict=lambda sd: _restore_like_megatron(adam, sd["step"]))
    tolerate_torch_adam_step(o)
    o.load_state_dict({"step": 1.0})
    steps = [adam.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == len(params) and all(float(s) == 1.0 for s in steps)
