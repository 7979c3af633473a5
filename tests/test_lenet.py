"""LeNet-5, the second network (common/nets/lenet.py), at every level that implements it: the network is PyTorch's, each
layer of each level matches float64 from its own inputs (per layer), and each step matches level 1's (lockstep).

Small on purpose: a few steps of 16 real digits. The whole chapter run, every step verified, is
`make compare ARGS="--model lenet"`.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.harness import verify, verify_lenet
from common.levels import level
from common.nets import get, lenet
from conftest import require, sanitize

pytestmark = pytest.mark.lenet
LENET = get("lenet")

# (level, device, variant): level 1 on either device and the benchmark's peers (level1_pytorch/peers.py); levels 4
# and 5 with each of their two convolutions; level 6 (cuDNN); level 7 (its own fused forward and training step); level 8
# on either device.
GPU1, GPU5, GPU6, GPU7, GPU8 = ([getattr(pytest.mark, f"level{n}"), pytest.mark.gpu] for n in (1, 5, 6, 7, 8))
IMPLEMENTATIONS = [
    pytest.param((1, "cuda", None), marks=GPU1, id="level1-cuda"),
    pytest.param((1, "cuda", "torch-eager"), marks=GPU1, id="torch-eager"),
    pytest.param((1, "cuda", "torch-graph"), marks=GPU1, id="torch-graph"),
    pytest.param((1, "cuda", "torch-compile"), marks=GPU1, id="torch-compile"),
    pytest.param((1, "cuda", "jax-scan"), marks=GPU1, id="jax-scan"),
    pytest.param((3, "cpu", None), marks=pytest.mark.level3, id="level3"),
    pytest.param((4, "cpu", "direct"), marks=pytest.mark.level4, id="level4-direct"),
    pytest.param((4, "cpu", "im2col"), marks=pytest.mark.level4, id="level4-im2col"),
    pytest.param((5, "cuda", "direct"), marks=GPU5, id="level5-direct"),
    pytest.param((5, "cuda", "tiled"), marks=GPU5, id="level5-tiled"),
    pytest.param((6, "cuda", None), marks=GPU6, id="level6"),
    pytest.param((7, "cuda", None), marks=GPU7, id="level7"),
    pytest.param((8, "cpu", None), marks=pytest.mark.level8, id="level8-cpu"),
    pytest.param((8, "cuda", None), marks=GPU8, id="level8-cuda"),
]


@pytest.fixture
def make(request):
    """params -> a fresh LeNet of the implementation under test (skips where this machine cannot run it)."""
    number, device, variant = request.param if hasattr(request, "param") else request.getfixturevalue("impl")
    require(level(number), device, request.config, LENET)
    if number == 1:
        from level1_pytorch.peers import missing, peers

        if variant and (why := missing(variant)):
            pytest.skip(why)
        cls = peers(LENET)[variant] if variant else level(1).load(LENET)
        return lambda params: cls(params, device=device)
    cls = level(number).load(LENET)
    if level(number).takes_device:
        return lambda params: cls(params, device=device)
    return (lambda params: cls(params, convolution=variant)) if variant else cls


def reference(params):
    return level(1).load(LENET)(params, device="cpu")


@pytest.fixture(scope="module")
def digits(mnist):
    return mnist[0][:16], mnist[1][:16]


@pytest.fixture(scope="module")
def trained(mnist):
    """Parameters after 40 steps of level 1 (batch 16, lr 0.05): past the first steps, where nothing is near a tie."""
    model = reference(lenet.init_params(1))
    model.train_epoch(mnist[0][:640], mnist[1][:640], 16, 0.05)
    return model.state_dict()


# ---- the network ----


@pytest.mark.level1
def test_the_network_is_pytorchs_lenet5():
    net = level(1).load(LENET)(lenet.init_params(0)).net
    shapes = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    assert shapes == lenet.SHAPES and list(shapes) == list(lenet.PARAM_NAMES)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 44_426
    layers = {name: type(m).__name__ for name, m in net.named_children()}
    assert list(layers) == list(lenet.ACTIVATIONS)  # a module per layer: forward hooks see each one
    assert list(layers.values()) == ["Conv2d", "ReLU", "MaxPool2d"] * 2 + ["Linear", "ReLU"] * 2 + ["Linear"]
    assert (net.conv1.kernel_size, net.conv1.stride, net.conv1.padding) == ((5, 5), (1, 1), (0, 0))


def test_the_initialization_is_the_mlps_by_fan_in():
    params = lenet.init_params(0)
    for name, value in params.items():
        if name.endswith("bias"):
            assert not value.any()
        else:
            bound = np.sqrt(2.0 / np.prod(value.shape[1:]))  # conv2: 6 x 5 x 5 = 150 inputs per unit
            assert value.dtype == np.float32 and np.abs(value).max() <= bound and np.abs(value).max() > 0.95 * bound
    assert all(np.array_equal(params[k], lenet.init_params(0)[k]) for k in params)


@pytest.mark.level1
def test_level1_layers_are_its_forward_pass(digits):
    model = reference(lenet.init_params(0))
    outputs, grads = model.layers(*digits)
    assert {k: v.shape[1:] for k, v in outputs.items()} == lenet.ACTIVATIONS
    np.testing.assert_array_equal(outputs["fc3"], model.forward(digits[0]))
    assert all(grads[k].shape == outputs[k].shape for k in outputs)


@pytest.mark.level1
def test_the_float64_step_is_level1s_float64_twin(digits):
    """lenet.forward64 (the verifier's yardstick, decisions exposed) against level 1's own float64 twin."""
    params = lenet.init_params(0)
    step = verify_lenet.LeNetStep(params, *digits, float(np.float32(0.05)))  # the float32 rate every level uses
    twin = level(1).load(LENET)(params, dtype="float64")
    losses = twin.train_epoch(*digits, 16, 0.05)
    assert abs(step.loss - losses[0]) <= 1e-12 * step.loss
    after = twin.state_dict()
    for name in lenet.PARAM_NAMES:
        np.testing.assert_allclose(step.params[name], after[name], rtol=0, atol=1e-12)


# ---- each level, layer by layer and step by step ----


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_every_layer_matches_float64_from_its_own_inputs(make, trained, digits, impl):
    shares, failure = verify_lenet.per_layer(make(trained).layers(*digits), reference(trained).layers(*digits),
                                             trained, *digits)
    assert failure is None, failure
    assert set(shares) >= set(verify_lenet.FORWARD) and max(shares.values()) <= 1


# JAX may miss the lockstep rule on LeNet-5: XLA's autotuner picks, for conv1's weight gradient, among cuDNN algorithms,
# timing them in the process that compiles, and some of them carry about ten times the float32 error the rule allows
# (after twenty steps on an H200: conv1's weights 1% off level 1's, the other layers within 1e-3). Which one it picks
# changes from run to run (on the H100 and the H200 these tests have both passed and failed), so the mark is not
# strict; the harness reports a peer's failed check with its reason, and its exit status is the levels'.
JAX_MISSES = pytest.mark.xfail(reason="XLA's autotuned cuDNN filter-gradient algorithm (see above)", strict=False)
JAX_MAY_MISS = [pytest.param(p.values[0], marks=[*p.marks, JAX_MISSES], id=p.id) if p.id == "jax-scan" else p
                for p in IMPLEMENTATIONS]


@pytest.mark.parametrize("impl", JAX_MAY_MISS)
def test_lockstep_with_level1_on_real_digits(make, trained, mnist, impl):
    X, y = mnist[0][:320], mnist[1][:320]
    records, diverged = verify.lockstep({"level": make(trained)}, trained, X, y, [np.arange(320, dtype=np.int32)], 16,
                                        0.05, network=LENET)
    record = records["level"]
    assert diverged is None and record.failure is None, record.failure
    assert len(record.used) == 20 and max(record.used) <= 1


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_partial_batch_is_a_smaller_step(make, trained, digits, impl):
    """21 rows in batches of 16: a step of 16 and one of 5, as level 1 takes them."""
    X, y = np.concatenate([digits[0], digits[0][:5]]), np.concatenate([digits[1], digits[1][:5]])
    got = make(trained).train_epoch(X, y, 16, 0.05)
    want = reference(trained).train_epoch(X, y, 16, 0.05)
    assert got.shape == (2,)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("impl", JAX_MAY_MISS)
def test_an_epoch_of_many_steps_follows_level1(make, trained, mnist, impl):
    """Ten steps in one call (lockstep takes one per call): each step must take its own rows - level 6 replays a
    captured step, which must not keep the first step's - and a second data set and learning rate must be taken up.
    The losses of a few steps from the same parameters agree to float32 noise (measured: ~1e-6 relative)."""
    model, want = make(trained), reference(trained)
    for X, y, lr in ((mnist[0][:160], mnist[1][:160], 0.05), (mnist[0][160:320], mnist[1][160:320], 0.02)):
        np.testing.assert_allclose(model.train_epoch(X, y, 16, lr), want.train_epoch(X, y, 16, lr), rtol=1e-4)
    for name, value in want.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name], value, rtol=1e-3, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_loss_and_grads_leave_the_parameters(make, trained, digits, impl):
    model = make(trained)
    loss, grads = model.loss_and_grads(*digits)
    assert set(grads) == set(lenet.PARAM_NAMES) and all(grads[k].shape == lenet.SHAPES[k] for k in grads)
    assert all(np.array_equal(model.state_dict()[k], trained[k]) for k in trained)
    assert np.isfinite(loss) and loss > 0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_input_is_named(make, trained, digits, impl):
    model = make(trained)
    with pytest.raises(ValueError, match="784"):
        model.forward(np.zeros((2, 28, 28), dtype=np.float32))
    with pytest.raises(ValueError, match="label"):
        model.train_epoch(digits[0], np.full(16, 10), 16, 0.05)
    wrong = dict(trained, **{"conv1.weight": np.zeros((6, 1, 3, 3), dtype=np.float32)})
    with pytest.raises(ValueError, match=r"conv1\.weight.*\(6, 1, 5, 5\)"):
        make(wrong)
    with pytest.raises(ValueError, match="keys"):
        make({k: v for k, v in trained.items() if k != "fc3.bias"})
    if impl[0] == 6:  # a convolution of another level: named, refused
        with pytest.raises(ValueError, match="level 6's convolutions are direct"):
            level(6).load(LENET)(trained, convolution="tiled")


@pytest.mark.parametrize("number, device, other", [
    pytest.param(4, "cpu", "im2col", marks=pytest.mark.level4, id="level4"),
    pytest.param(5, "cuda", "tiled", marks=GPU5, id="level5"),
])
def test_each_levels_two_convolutions_agree(request, trained, digits, number, device, other):
    """The lesson of the level against its direct convolution, every layer. The tiled kernel adds the same terms in
    the same order as the direct one, so it must give the same bits; im2col's matrix product adds them its own way."""
    require(level(number), device, request.config, LENET)
    cls = level(number).load(LENET)
    direct, lesson = (cls(trained, convolution=c).layers(*digits) for c in ("direct", other))
    for name in lenet.ACTIVATIONS:
        if other == "tiled":
            np.testing.assert_array_equal(direct[0][name], lesson[0][name], err_msg=name)
            np.testing.assert_array_equal(direct[1][name], lesson[1][name], err_msg=name)
        else:
            np.testing.assert_allclose(direct[0][name], lesson[0][name], rtol=1e-4, atol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match="convolution"):
        cls(trained, convolution="fft")
    missing_one = {"im2col": "tiled", "tiled": "im2col"}[other]  # the other level's lesson: named, refused
    with pytest.raises(ValueError, match=f"level {number}'s convolutions are direct and {other}"):
        cls(trained, convolution=missing_one)


# Every (level, convolution) the model list names, as the harness builds it.
HARNESS_VARIANTS = [pytest.param(number, convolution, marks=GPU5 if number == 5 else pytest.mark.level4,
                                 id=f"level{number}-{convolution}")
                    for number, convolutions in get("lenet").convolutions for convolution in convolutions]


@pytest.mark.parametrize("number, convolution", HARNESS_VARIANTS)
def test_the_harness_builds_each_variant_it_names(request, trained, number, convolution):
    """compare.factory hands every option to every level, and the model it builds reports (read back from its
    library) the convolution its row is named for."""
    from common.harness import compare

    device = "cuda" if number == 5 else "cpu"
    require(level(number), device, request.config, LENET)
    model = compare.factory(level(number), device, LENET, convolution=convolution)(trained)
    assert model.variant() == {"device": device, "convolution": convolution}


@pytest.mark.level4
def test_level4s_two_convolutions_train_differently(request, trained, mnist):
    """im2col adds a convolution's terms in another order than the direct loops: the two cannot train to the same
    bits. (Identical losses would mean one convolution ran under both names.)"""
    require(level(4), "cpu", request.config, LENET)
    X, y = mnist[0][:320], mnist[1][:320]
    losses = [level(4).load(LENET)(trained, convolution=c).train_epoch(X, y, 16, 0.05) for c in ("direct", "im2col")]
    assert not np.array_equal(losses[0], losses[1])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.level5
def test_level5s_tiled_convolution_is_the_kernel_that_runs(request, trained, digits):
    """The tiled kernel adds the same terms in the same order as the direct one (the same bits, by design), so its
    row is told apart by the kernels it launches: the profiler sees the tiled forward kernel for "tiled" only."""
    require(level(5), "cuda", request.config, LENET)
    from torch.profiler import ProfilerActivity, profile

    launched = {}
    for convolution in ("direct", "tiled"):
        model = level(5).load(LENET)(trained, convolution=convolution)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.train_epoch(*digits, 8, 0.05)
        launched[convolution] = {e.name.split("(")[0].removeprefix("void ") for e in prof.events()
                                 if e.device_type.name == "CUDA"}
    assert "conv2d_forward_tiled_kernel" in launched["tiled"]
    assert "conv2d_forward_tiled_kernel" not in launched["direct"] and "conv2d_forward_kernel" in launched["direct"]


@pytest.mark.gpu
@pytest.mark.level7
def test_level7s_training_is_its_own_two_kernels(request, trained, digits):
    """Level 7 includes level 6's library calls but trains without them: a step, and the forward and backward that
    the per-layer check reads, launch its two kernels and nothing else (no cuDNN, no cuBLAS)."""
    require(level(7), "cuda", request.config, LENET)
    from torch.profiler import ProfilerActivity, profile

    model = level(7).load(LENET)(trained)
    for call in (lambda: model.train_epoch(*digits, 8, 0.05), lambda: model.layers(*digits),
                 lambda: model.loss_and_grads(*digits)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
        kernels = {e.name.split("(")[0].removeprefix("void ") for e in prof.events() if e.device_type.name == "CUDA"}
        assert {k for k in kernels if not k.startswith(("Memcpy", "Memset"))} == {"lenet_train_images",
                                                                                 "lenet_train_update"}


@pytest.mark.gpu
@pytest.mark.parametrize("number, convolution", [
    pytest.param(5, "direct", marks=pytest.mark.level5, id="level5-direct"),
    pytest.param(5, "tiled", marks=pytest.mark.level5, id="level5-tiled"),
    pytest.param(6, "direct", marks=pytest.mark.level6, id="level6"),
    pytest.param(7, "direct", marks=pytest.mark.level7, id="level7"),
])
def test_gpu_reruns_are_bit_identical_at_odd_sizes(request, mnist, number, convolution):
    """No atomics anywhere (level 6: cuDNN's deterministic algorithms; level 7: its sums over the batch in a fixed
    order): two runs give the same bits. Batches of 37
    (tiles cut by the edge of the batch) and a forward pass across FORWARD_CHUNK (1,030 rows), against level 4."""
    require(level(number), "cuda", request.config, LENET)
    X, y = mnist[0][:1030], mnist[1][:1030]
    runs = []
    for _ in range(2):
        model = level(number).load(LENET)(lenet.init_params(3), convolution=convolution)
        runs.append((model.train_epoch(X[:370], y[:370], 37, 0.05), model.forward(X), model.state_dict()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    cpu = level(4).load(LENET)(runs[0][2])
    np.testing.assert_allclose(runs[0][1], cpu.forward(X), rtol=1e-4, atol=1e-4)


# Partial batches (75 = 2 x 37 + 1), tiles cut by the image's edge, a forward pass across FORWARD_CHUNK (1,030 rows),
# and inference: its graph, recaptured for another batch, and every layer kept (level 7's fused kernel).
SANITIZER_SCRIPT = """
import numpy as np
from common.nets.lenet import init_params
from {package} import LeNet
rng = np.random.default_rng(0)
X, y = rng.standard_normal((1030, 784)).astype(np.float32), rng.integers(0, 10, 1030)
for convolution in {convolutions}:
    model = LeNet(init_params(0), convolution=convolution)
    model.train_epoch(X[:75], y[:75], 37, 0.05)
    model.forward(X)
    model.layers(X[:5], y[:5])
    for rows in (1, 1030, 3):
        model.infer_load(X[:rows])
        model.infer_run()
        model.infer_layers()
"""


@pytest.mark.gpu
@pytest.mark.parametrize("number", [pytest.param(5, marks=pytest.mark.level5, id="level5"),
                                    pytest.param(6, marks=pytest.mark.level6, id="level6"),
                                    pytest.param(7, marks=pytest.mark.level7, id="level7")])
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_gpu_kernels_are_clean_under_compute_sanitizer(request, tool, number):
    """A read past the halo, a tile read before every thread has written it, a barrier some threads skip: none need
    change a loss, and compute-sanitizer sees each (level 6: around cuDNN's and cuBLAS's kernels, and its graph)."""
    require(level(number), "cuda", request.config, LENET)
    convolutions = ("direct", "tiled") if number == 5 else ("direct",)
    sanitize(tool, SANITIZER_SCRIPT.format(package=level(number).package, convolutions=convolutions))


def test_the_network_list_names_each_networks_parts():
    assert LENET.network is lenet and LENET.levels == (1, 2, 3, 4, 5, 6, 7, 8)
    assert LENET.float64_step() is verify_lenet.LeNetStep and LENET.per_layer_check() is verify_lenet.per_layer
    assert "no network 'resnet'" in str(pytest.raises(KeyError, get, "resnet").value)
