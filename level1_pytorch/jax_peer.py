"""The JAX peer: each network as a JAX user writes it for speed, a whole epoch as one jit-compiled `lax.scan`.

Float32 throughout, with JAX's "highest" matmul precision (no TF32, as everywhere in this course). The data set is put
on the device once; the scan gathers each step's batch there, takes the loss and its gradients, applies SGD, and
collects the losses, which are read back once per epoch. A final partial batch is one more jit-compiled step.
It implements the level contract, so the harness verifies it like any level before it reports its speed
(level1_pytorch/peers.py). JAX is optional: `pip install "jax[cuda13]"`. On LeNet-5 XLA's autotuner picks cuDNN's
convolution algorithms, and some of them miss the lockstep rule (README, tests/test_lenet.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch: no 75% taken at start

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common.contract import DataCache, check_params, check_training, check_X, check_y  # noqa: E402
from common.nets import lenet, mlp  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # float32 products, not TF32


# ---- the two networks, as functions of their parameters (PyTorch's names and layouts) ----


def linear(p: dict, name: str, a):
    """a (N, in) @ weight (out, in).T + bias."""
    return a @ p[f"{name}.weight"].T + p[f"{name}.bias"]


def mlp_outputs(p: dict, x, probes: dict | None = None) -> dict:
    """784 -> hidden (ReLU) -> 10, every layer's output; `probes` as lenet_outputs' (below)."""
    outputs = {}
    outputs["fc1"] = linear(p, "fc1", x) + (probes["fc1"] if probes else 0)
    outputs["relu1"] = jax.nn.relu(outputs["fc1"]) + (probes["relu1"] if probes else 0)
    outputs["fc2"] = linear(p, "fc2", outputs["relu1"]) + (probes["fc2"] if probes else 0)
    return outputs


def mlp_logits(p: dict, x):
    """784 -> hidden (ReLU) -> 10."""
    return mlp_outputs(p, x)["fc2"]


def conv(p: dict, name: str, a):
    """A valid 5x5 convolution, stride 1: a (N, C, H, W), weight (F, C, 5, 5), bias (F,)."""
    out = jax.lax.conv_general_dilated(a, p[f"{name}.weight"], (1, 1), "VALID",
                                       dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return out + p[f"{name}.bias"][None, :, None, None]


def max_pool(a):
    """2x2 windows, stride 2."""
    return jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


LENET_LAYERS = {  # lenet.ACTIVATIONS's layers, in order: each a function of (parameters, the layer before's output)
    "conv1": lambda p, a: conv(p, "conv1", a.reshape(-1, 1, lenet.IMAGE, lenet.IMAGE)),
    "relu1": lambda p, a: jax.nn.relu(a), "pool1": lambda p, a: max_pool(a),
    "conv2": lambda p, a: conv(p, "conv2", a), "relu2": lambda p, a: jax.nn.relu(a), "pool2": lambda p, a: max_pool(a),
    "fc1": lambda p, a: linear(p, "fc1", a.reshape(a.shape[0], -1)), "relu3": lambda p, a: jax.nn.relu(a),
    "fc2": lambda p, a: linear(p, "fc2", a), "relu4": lambda p, a: jax.nn.relu(a),
    "fc3": lambda p, a: linear(p, "fc3", a),
}


def lenet_outputs(p: dict, x, probes: dict | None = None) -> dict:
    """Every layer's output; `probes` (zeros, one per layer) are added to them, so that the gradient with respect to
    a probe is the gradient with respect to its layer's output."""
    outputs, a = {}, x
    for name, layer in LENET_LAYERS.items():
        a = outputs[name] = layer(p, a) + (probes[name] if probes else 0)
    return outputs


def lenet_logits(p: dict, x):
    """conv1 -> ReLU -> max-pool -> conv2 -> ReLU -> max-pool -> fc1 -> ReLU -> fc2 -> ReLU -> fc3."""
    return lenet_outputs(p, x)["fc3"]


# ---- training: one step, and an epoch of them as a scan ----


def cross_entropy(logits, y):
    """Mean cross-entropy of a batch's logits (N, 10) with its labels (N,)."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, y[:, None], axis=1)[:, 0])


def mean_loss(logits_of, p: dict, x, y):
    return cross_entropy(logits_of(p, x), y)


def sgd_step(logits_of, p: dict, X, y, index, lr):
    """One SGD step on the batch `index` of the data set: (new parameters, the loss before the update)."""
    loss, grads = jax.value_and_grad(lambda q: mean_loss(logits_of, q, X[index], y[index]))(p)
    return jax.tree_util.tree_map(lambda w, g: w - lr * g, p, grads), loss


def scan_steps(logits_of, p: dict, X, y, batches, lr):
    """Steps over batches (steps, batch): (the parameters after them, each step's loss)."""
    return jax.lax.scan(lambda q, index: sgd_step(logits_of, q, X, y, index, lr), p, batches)


# the network's function is static (one compilation per network and shape); the old parameters' memory is reused
scan_steps = jax.jit(scan_steps, static_argnums=0, donate_argnums=1)
one_step = jax.jit(sgd_step, static_argnums=0, donate_argnums=1)
value_and_grads = jax.jit(jax.value_and_grad(mean_loss, argnums=1), static_argnums=0)
logits = jax.jit(lambda logits_of, p, x: logits_of(p, x), static_argnums=0)


def layer_outputs(outputs_of, p: dict, x, y) -> tuple[dict, dict]:
    """A network's layer outputs for a batch, and the mean loss's gradient with respect to each (outputs_of: the
    network's function of (parameters, x, probes) -> every layer's output, the last the logits)."""
    def loss(probes):
        return cross_entropy(list(outputs_of(p, x, probes).values())[-1], y)

    zeros = {name: jnp.zeros(out.shape, out.dtype) for name, out in outputs_of(p, x).items()}
    return outputs_of(p, x), jax.grad(loss)(zeros)


layer_outputs = jax.jit(layer_outputs, static_argnums=0)


class JaxScan:
    """The level contract in JAX, for the network of `network` (common/nets/mlp.py, common/nets/lenet.py) and `logits_of`."""

    network = mlp
    logits_of = staticmethod(mlp_logits)
    outputs_of = staticmethod(mlp_outputs)

    def __init__(self, params: dict[str, np.ndarray], device: str = "cuda"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        try:
            self._device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        except RuntimeError as e:
            raise RuntimeError(f"device={device!r} asked for, but JAX has no such backend ({e})") from None
        checked = check_params(params, network=self.network)
        self._hidden = checked["fc1.weight"].shape[0] if self.network is mlp else None  # the MLP's, kept
        self.load_state_dict(params)
        self._data = DataCache()
        self._forward_programs: dict[tuple, object] = {}  # the logits' compiled program, by the shape of x

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        X_dev, y_dev = self._data.fetch(X, y, self._upload)
        order, batch_size, lr = check_training(X_dev.shape[0], batch_size, lr, order)
        full = len(order) // batch_size
        losses = []
        if full:
            batches = self._put(order[: full * batch_size].reshape(full, batch_size))
            self._params, scanned = scan_steps(self.logits_of, self._params, X_dev, y_dev, batches, lr)
            losses.append(scanned)
        if full * batch_size < len(order):
            rest = self._put(order[full * batch_size :])
            self._params, last = one_step(self.logits_of, self._params, X_dev, y_dev, rest, lr)
            losses.append(last[None])
        return np.asarray(jnp.concatenate(losses))

    def variant(self) -> dict[str, str]:
        """Its device, read from JAX, and how it is written."""
        return {"device": "cuda" if self._device.platform == "gpu" else "cpu",
                "written as": "the epoch as one jit-compiled lax.scan, float32 'highest' matmuls"}

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        X = check_X(X)
        loss, grads = value_and_grads(self.logits_of, self._params, self._put(X), self._put(check_y(y, len(X))))
        return float(loss), {name: np.array(g) for name, g in grads.items()}

    def forward(self, X: np.ndarray) -> np.ndarray:
        x = self._put(check_X(X))
        return np.array(self._forward_program(x)(self._params, x))

    def _forward_program(self, x):
        """The logits' program for x's shape, compiled once. On a GPU without XLA's autotuning of its products, which
        tries each product's candidate kernels for seconds (15 s for the test set's 10,000 rows on an H200) to save
        microseconds: forward is untimed (the test set's predictions). The training step keeps the autotuning."""
        programs = self._forward_programs
        if x.shape not in programs:
            options = {"xla_gpu_autotune_level": 0} if self._device.platform == "gpu" else {}
            programs[x.shape] = logits.lower(self.logits_of, self._params, x).compile(compiler_options=options)
        return programs[x.shape]

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each."""
        X = check_X(X)
        outputs, grads = layer_outputs(self.outputs_of, self._params, self._put(X), self._put(check_y(y, len(X))))
        return ({k: np.array(v) for k, v in outputs.items()}, {k: np.array(v) for k, v in grads.items()})

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: np.array(p) for name, p in self._params.items()}

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        params = check_params(params, self._hidden, network=self.network)
        self._params = {name: self._put(params[name]) for name in self.network.PARAM_NAMES}

    def _upload(self, X: np.ndarray, y: np.ndarray):
        return self._put(X), self._put(y)

    def _put(self, a: np.ndarray):
        return jax.device_put(a, self._device)


class JaxLeNet(JaxScan):
    """LeNet-5."""

    network = lenet
    logits_of = staticmethod(lenet_logits)
    outputs_of = staticmethod(lenet_outputs)


def jax_peer(network) -> type:
    """The JAX peer of a network of common/nets."""
    return {"mlp": JaxScan, "lenet": JaxLeNet}[network.name]
