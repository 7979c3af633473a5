"""Plant the chapter's classic bugs, each in a copy of its own, and show which tests catch each.

    python tests/plant_bugs.py                     # the CPU levels: 1 to 4, and 8 (its CPU backend)
    python tests/plant_bugs.py --levels 5,6,7 -- --require-gpu   # on the GPU machine; after -- : pytest options
    python tests/plant_bugs.py --jobs 2 -- -n 8                 # two bugs at once, each tested on 8 workers

Each bug is a one-line edit applied to a scratch copy of the repository (the working tree is never
touched), which is then built and tested with `pytest -m levelN`. A bug that no test catches is a
hole in the test suite: the script exits non-zero. Students can add their own bugs to BUGS. The lab's tests
(tests/test_labs.py) plant them too, each in the grade table, where it must fail exactly its own task.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.classroom.grade import BUILDS

ROOT = Path(__file__).resolve().parent.parent

# Adam's bugs, planted at level 3 and caught by the lockstep with Adam (as file, correct code, buggy code, what): in
# adam_update, which level 8's Adam calls too, and in level 3's model, which carries the moments from step to step.
ADAM_UPDATE_BUGS = [
    ("level3_numpy/mlp.py", ("bias_correction1 = 1 - beta1**step", "bias_correction2_sqrt = (1 - beta2**step) ** 0.5"),
     ("bias_correction1 = 1", "bias_correction2_sqrt = 1.0"), "Adam without bias correction"),
    ("level3_numpy/mlp.py", "denom = np.sqrt(v) / np.float32(bias_correction2_sqrt) + np.float32(eps)",
     "denom = np.sqrt(v + np.float32(eps)) / np.float32(bias_correction2_sqrt)", "Adam's eps inside the square root"),
]
ADAM_BUGS = [
    *ADAM_UPDATE_BUGS,
    ("level3_numpy/mlp.py", "if not self.steps:  # Adam's first step", "if True:  # Adam's first step",
     "Adam's moments not carried over (zeros at every step)"),
]

# (level, file, the correct code, the buggy code, what the bug is); a bug of several edits gives tuples.
BUGS = [
    (1, "level1_pytorch/mlp.py", "self.optimizer.zero_grad()\n                loss.backward()", "loss.backward()",
     "gradients never zeroed between steps"),
    (2, "level2_theory/backprop.py", "return dlogits / len(y)", "return dlogits",
     "gradients not divided by the batch size"),
    (2, "level2_theory/backprop.py", "return da * (h > 0)", "return da * (da > 0)",
     "ReLU mask taken from the wrong tensor"),
    (2, "level2_theory/backprop.py", "dW = dout.T @ x ", "dW = x.T @ dout ", "transposed weight gradient"),
    # the chain rule automated (level2_theory/autograd.py)
    (2, "level2_theory/autograd.py", "for node in reversed(order):", "for node in order:",
     "autograd: the topological order walked the wrong way (parents before the nodes computed from them)"),
    (2, "level2_theory/autograd.py", "parent.grad += local * node.grad", "parent.grad = local * node.grad",
     "autograd: a gradient overwritten where a value is used twice"),
    (2, "level2_theory/autograd.py", "node.grad = 0.0", "node.grad += 0.0",
     "autograd: the graph's grads not zeroed, so a second backward() adds to the first"),
    (2, "level2_theory/autograd.py", "        if id(node) in visited:\n            continue\n", "",
     "autograd: the sort without its visited set (a node reached along two paths listed twice)"),
    (2, "level2_theory/autograd.py", "m = Value(max(v.data for v in z))", "m = Value(0.0)",
     "autograd: log-sum-exp without the max (exp() overflows on large logits)"),
    (3, "level3_numpy/mlp.py", "return dlogits / len(y)", "return dlogits", "gradients not divided by the batch size"),
    (3, "level3_numpy/mlp.py", "return da * (h > 0)", "return da * (h >= 0)", "ReLU gradient wrong at exactly 0"),
    (3, "level3_numpy/mlp.py", "return da * (h > 0)", "return da * (da > 0)", "ReLU mask taken from the wrong tensor"),
    (3, "level3_numpy/mlp.py", "dout.T @ x, dout.sum(axis=0)", "dout.T @ x, 0 * dout.sum(axis=0)", "bias gradient missing"),
    (3, "level3_numpy/mlp.py", "shifted = logits - logits.max(axis=1, keepdims=True)", "shifted = logits",
     "softmax without max subtraction"),
    (3, "level3_numpy/mlp.py", "np.empty(n_steps(len(order), batch_size)", "np.empty(len(order) // batch_size",
     "final partial batch dropped"),
    (3, "level3_numpy/mlp.py", "params[name] -= lr * grad", "params[name] -= np.float32(lr * 1.002) * grad",
     "learning rate 0.2% too large"),
    # Adam (adam_update, and the model's moments), caught by the lockstep with Adam
    *((3, *bug) for bug in ADAM_BUGS),
    # LeNet-5 (level3_numpy/lenet.py)
    (3, "level3_numpy/lenet.py", "im2col(x, k) @ w.reshape(f, -1).T + b", "im2col(x, k) @ w[:, :, ::-1, ::-1].reshape(f, -1).T + b",
     "LeNet: a convolution instead of a correlation (the kernel flipped)"),
    (3, "level3_numpy/lenet.py", "oh, ow = h - k + 1, w - k + 1", "oh, ow = h - k, w - k",
     "LeNet: col2im's output size off by one"),
    (3, "level3_numpy/lenet.py", "patches.transpose(0, 2, 3, 1, 4, 5)", "patches.transpose(0, 2, 3, 1, 5, 4)",
     "LeNet: im2col's column order swapped (a patch's rows and columns)"),
    (3, "level3_numpy/lenet.py", "np.put_along_axis(win, choice[..., None], dout[..., None], axis=-1)",
     "win[...] = dout[..., None]", "LeNet: the pool's gradient sent to every element of its window"),
    (3, "level3_numpy/lenet.py", "choice = win.argmax(axis=-1)", "choice = 3 - win[..., ::-1].argmax(axis=-1)",
     "LeNet: the pool takes the last of equal maxima, where PyTorch takes the first"),
    (3, "level3_numpy/lenet.py", 'keep["pool2"].reshape(len(x), -1)', 'keep["pool2"].transpose(0, 2, 3, 1).reshape(len(x), -1)',
     "LeNet: the flatten order not PyTorch's (channels last)"),
    (4, "level4_c/mlp.c", "(probs[i] - onehot) / (float)B;", "(probs[i] - onehot);",
     "gradients not divided by the batch size"),
    (4, "level4_c/mlp.c", "            db[o] += g;\n", "", "bias gradient missing"),
    (4, "level4_c/mlp.c", "relu_backward(m->dh, m->da, m->h, (size_t)B * H);", "relu_backward(m->dh, m->da, m->da, (size_t)B * H);",
     "ReLU mask taken from the wrong tensor"),
    (4, "level4_c/mlp.c", "dh[i] = h[i] > 0.0f ? da[i] : 0.0f;", "dh[i] = h[i] >= 0.0f ? da[i] : 0.0f;",
     "ReLU gradient wrong at exactly 0"),
    (4, "level4_c/mlp.c", ("float max = row[0];", "        for (int o = 1; o < n_out; o++) max = row[o] > max ? row[o] : max;\n"),
     ("float max = 0.0f;", ""), "softmax without max subtraction"),
    (4, "level4_c/mlp.c", "start < n_order; start += batch_size, step++",
     "start + batch_size <= n_order; start += batch_size, step++", "final partial batch dropped"),
    (4, "level4_c/mlp.c", "dw_row[k] += g * x_row[k];", "dw[(size_t)k * n_out + o] += g * x_row[k];",
     "transposed weight index"),
    (4, "level4_c/mlp.c", "p[i] -= lr * dp[i];", "p[i] -= 1.002f * lr * dp[i];", "learning rate 0.2% too large"),
    (4, "level4_c/mlp.c", "linear_forward(m->h, x + (size_t)start * m->n_in,", "linear_forward(m->h, x,",
     "forward() repeats its first chunk of rows"),
    (4, "level4_c/mlp.c", "m->h = malloc(sizeof(float) * R * m->hidden);", "m->h = malloc(sizeof(float) * R * m->n_out);",
     "a batch buffer allocated too small"),
    (4, "level4_c/mlp.c", "    free(m->dw1), free(m->db1), free(m->dw2), free(m->db2);\n", "", "gradients never freed"),
    # LeNet-5 (level4_c/lenet.c)
    (4, "level4_c/lenet.c", "const float weight = w[(((size_t)f * C + c) * k + i) * k + j];",
     "const float weight = w[(((size_t)f * C + c) * k + (k - 1 - i)) * k + (k - 1 - j)];",
     "LeNet: a convolution instead of a correlation (the kernel flipped)"),
    (4, "level4_c/lenet.c", "    const int OH = H - k + 1;\n    for (int n = 0; n < B; n++)\n        for (int f = 0; f < F; f++) {",
     "    const int OH = H - k;\n    for (int n = 0; n < B; n++)\n        for (int f = 0; f < F; f++) {",
     "LeNet: the direct convolution's output size off by one"),
    (4, "level4_c/lenet.c", "memcpy(row + ((size_t)c * k + i) * k,", "memcpy(row + ((size_t)i * C + c) * k,",
     "LeNet: im2col's column order swapped (channel and kernel row)"),
    (4, "level4_c/lenet.c", "da[plane * H * H + (size_t)(2 * py + choice[i] / 2) * H + 2 * px + choice[i] % 2] = dout[i];",
     "for (int e = 0; e < 4; e++) da[plane * H * H + (size_t)(2 * py + e / 2) * H + 2 * px + e % 2] = dout[i] + 0 * choice[i];",
     "LeNet: the pool's gradient sent to every element of its window"),
    (4, "level4_c/lenet.c", "best = v[i] > v[best] ? i : best;", "best = v[i] >= v[best] ? i : best;",
     "LeNet: the pool takes the last of equal maxima, where PyTorch takes the first"),
    (5, "common/native/cuda_mlp.cuh", "dlogits[i] = (probs[i] - onehot) / (float)B;", "dlogits[i] = (probs[i] - onehot);",
     "gradients not divided by the batch size"),
    (5, "level5_cuda_naive/mlp.cu", "if (r >= B || o >= n_out) return;", "if (o >= n_out) return;",
     "a kernel that ignores its bounds check on a partial batch"),
    (5, "common/native/cuda_mlp.cuh", "    max = warp_max(max);\n", "", "softmax max per thread instead of per row"),
    (5, "common/native/cuda_mlp.cuh", "dh[i] = h[i] > 0.0f ? da[i] : 0.0f;", "dh[i] = h[i] >= 0.0f ? da[i] : 0.0f;",
     "ReLU gradient wrong at exactly 0"),
    (5, "common/native/cuda_mlp.cuh", "p[i] -= lr * dp[i];", "p[i] -= 1.002f * lr * dp[i];", "learning rate 0.2% too large"),
    (5, "common/native/cuda_mlp.cuh", "m->x, x + (size_t)start * m->n_in,", "m->x, x,", "forward() repeats its first chunk of rows"),
    # Level 5's kernels 2 and 3 (level5_cuda_naive/matmul.cuh)
    (5, "level5_cuda_naive/matmul.cuh",
     "        __syncthreads(); /* both tiles are whole before any thread reads them */\n        for (int k = 0;",
     "        for (int k = 0;", "kernel 2 (tiled): no __syncthreads() between staging the tiles and reading them"),
    (5, "level5_cuda_naive/matmul.cuh",
     ("        __syncthreads(); /* every thread is done with these tiles before the next ones are staged over them */\n"
      "    }\n#pragma unroll"),
     "    }\n#pragma unroll",
     "kernel 3 (blocked): no __syncthreads() before the next tiles are staged over the ones still being read"),
    (5, "level5_cuda_naive/matmul.cuh", "i < a.rows && j < a.cols ? a.at(i, j)", "i <= a.rows && j <= a.cols ? a.at(i, j)",
     "kernels 2 and 3: a tile's bounds off by one (<= for <), reading a row and a column past a matrix's edge"),
    (5, "level5_cuda_naive/matmul.cuh", "if (row < a.rows && col < b.cols) c[(size_t)row * b.cols + col] = sum[i][j];",
     "if (row <= a.rows && col <= b.cols) c[(size_t)row * b.cols + col] = sum[i][j];",
     "kernel 3 (blocked): its store's bounds off by one, writing a row and a column past the output"),
    (5, "level5_cuda_naive/matmul.cuh", "const bool tiled = m->matmul == MLP_MATMUL_TILED;",
     "const bool tiled = m->matmul != MLP_MATMUL_NAIVE;",
     "kernel 3's row runs kernel 2 (the same bits: only the kernels it launches tell)"),
    # LeNet-5 (level5_cuda_naive/lenet.cu)
    (5, "level5_cuda_naive/lenet.cu", "const bool inside = n < B && row < H && col < H;",
     "const bool inside = n < B && row < H && col < H && e / IN % IN < IN - 1;",
     "LeNet: the tiled convolution's halo one row short"),
    (5, "level5_cuda_naive/lenet.cu", "    __syncthreads(); /* every input and weight is in shared memory before anyone reads one */\n", "",
     "LeNet: no __syncthreads() between loading the tile and reading it"),
    (5, "level5_cuda_naive/lenet.cu", "const float *in = x + ((n * C + c) * H + oy) * H + ox,",
     "const float *in = x + ((n * H + oy) * H + ox) * C + c,", "LeNet: the input (N, C, H, W) read as (N, H, W, C)"),
    (6, "level6_cublas/mlp.cu", "&one, w, n_in, x, n_in, &zero, out,", "&one, w, n_in, x, n_out, &zero, out,",
     "a wrong leading dimension"),
    (6, "level6_cublas/mlp.cu", "CUBLAS_OP_T, CUBLAS_OP_N, n_out, B, n_in", "CUBLAS_OP_N, CUBLAS_OP_T, n_out, B, n_in",
     "a swapped transpose flag"),
    (6, "level6_cublas/mlp.cu", "&one, x, n_in, dout, n_out, &zero, dw,", "&one, x, n_in, dout, n_out, &one, dw,",
     "beta = 1 instead of 0 on a gradient product"),
    # LeNet-5 (level6_cublas/lenet.cu)
    (6, "level6_cublas/lenet.cu", "MATH = CUDNN_FMA_MATH;", "MATH = CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;",
     "LeNet: TF32 left on in cuDNN (FP32 convolutions on tensor cores)"),
    (6, "level6_cublas/lenet.cu", "BACKWARD_FILTER = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT;",
     "BACKWARD_FILTER = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0;", "LeNet: a non-deterministic backward algorithm"),
    (6, "level6_cublas/lenet.cu", "return one_step(m, s->step_order, B, lr, s->step_loss); });",
     "return one_step(m, m->order, B, lr, s->step_loss); });",
     "LeNet: the step's graph captured with a stale input pointer (every replay takes the first rows)"),
    (7, "level7_fused/mlp.cu", "    grid_barrier(a.barrier, gridDim.x);\n}", "}",
     "the grid's exchange without its barrier: blocks read shares of the logits not yet written"),
    (7, "level7_fused/mlp.cu", "        mbarrier_wait(&s.arrived[st.half], st.index / 2 % 2);\n", "",
     "the cluster's exchange without its wait: blocks read shares of the logits still on their way"),
    (7, "level7_fused/mlp.cu", "s.dh[i] = s.h[i] > 0.0f ? da : 0.0f;", "s.dh[i] = s.h[i] >= 0.0f ? da : 0.0f;",
     "ReLU gradient wrong at exactly 0 (the fused epoch)"),
    (7, "level7_fused/mlp.cu",
     ("s.shares + ((size_t)half * gridDim.x + from)", "a.exchange + ((size_t)half * gridDim.x + from)"),
     ("s.shares + ((size_t)0 * gridDim.x + from)", "a.exchange + ((size_t)0 * gridDim.x + from)"),
     "the exchange not double-buffered: a block that runs ahead overwrites shares another still reads"),
    (7, "level7_fused/mlp.cu", "const int j0 = g * units;", "const int j0 = g * (units - 1);",
     "a wrong owner of a weight slice: neighbouring blocks share a unit"),
    (7, "level7_fused/mlp.cu", "st.rows = min(a.batch, a.n_order - st.start);", "st.rows = a.batch;",
     "the partial last batch taken as a whole one"),
    # LeNet-5 (level7_fused/lenet.cu): its forward, one fused kernel
    (7, "level7_fused/lenet.cu", "        __syncthreads();          /* and everyone's */\n", "",
     "LeNet: no __syncthreads() between loading the images and convolving them"),
    (7, "level7_fused/lenet.cu", "float best = 0.0f; /* the max of the ReLUs", "float best = -INFINITY; /* the max of the ReLUs",
     "LeNet: max-pool of the convolution before its ReLU (a window of negatives pools to a negative)"),
    (7, "level7_fused/lenet.cu", "    for (int i = n / 4 * 4 + threadIdx.x; i < n; i += blockDim.x) __pipeline_memcpy_async(dst + i, src + i, 4);\n",
     "", "LeNet: the copy's odd tail dropped (the last two of fc3's biases never reach shared memory)"),
    # LeNet-5 (level7_fused/lenet.cu): its training step, two kernels
    (7, "level7_fused/lenet.cu", "best = v[d] > v[best] ? d : best;", "best = v[d] >= v[best] ? d : best;",
     "LeNet's fused step: max-pool choosing the last of equal maxima (PyTorch takes the first)"),
    (7, "level7_fused/lenet.cu", "/* a2 becomes dh2 */\n    __syncthreads();\n", "/* a2 becomes dh2 */\n",
     "LeNet's fused step: conv2's gradients read dh2 before every thread has written it"),
    (7, "level7_fused/lenet.cu", "const int b = blockIdx.x, row = a.rows ? a.rows[b] : b;",
     "const int b = blockIdx.x, row = b;", "LeNet's fused step: every step trains on the data set's first rows"),
    (7, "level7_fused/lenet.cu", "for (int r = 0; r < RUNS; r++) g += runs[r][lane];",
     "for (int r = 0; r < RUNS - 1; r++) g += runs[r][lane];",
     "LeNet's fused step: a run of the batch's rows left out of every gradient"),
    # Level 8, the framework (its CPU backend; its optimizers' updates are level 3's)
    (8, "level8_framework/cpu.py", "else a.T @ g", "else g.T @ a", "matmul's db transposed"),
    (8, "level8_framework/cpu.py", ("return g.sum(axis=0)", "return g.sum(axis=axes).reshape(shape)"),
     ("return g[0]", "return g[(0,) * lead].reshape(shape)"),
     "broadcast backward not summed (the bias gets the first row's gradient)"),
    (8, "level8_framework/tensor.py", "grads[key] = i.backend.add(grads[key], gi)", "grads[key] = gi",
     "a gradient overwritten where a tensor is used twice"),
    (8, "level8_framework/tensor.py", "for t in reversed(order):", "for t in order:",
     "the topological order walked the wrong way (inputs before the tensors computed from them)"),
    *((8, *bug) for bug in ADAM_UPDATE_BUGS),  # level 8's optim.Adam calls level 3's adam_update
    (8, "level8_framework/optim.py", 'buf = state.get("momentum_buffer")', "buf = None",
     "momentum buffer not carried over (every step a first step)"),
    (8, "level8_framework/cpu.py", "np.float32(2 / x.size)", "np.float32(2)", "MSE's gradient without its 1/N"),
]


def scratch_copy() -> Path:
    """The repository without its environment, history, data and outputs (data is linked, not copied), but with its
    built libraries and their times: make then rebuilds only what depends on the file a bug is planted in (written
    after them), not every library from the start."""
    target = Path(tempfile.mkdtemp(prefix="plant-")) / "repo"
    left_out = shutil.ignore_patterns(".venv", ".git", "data", "results", "lab", "grade.json")
    shutil.copytree(ROOT, target, ignore=left_out)
    if (ROOT / "data").exists():
        (target / "data").symlink_to(ROOT / "data")
    return target


def edits(good, bad) -> list[tuple[str, str]]:
    """A bug's (correct code, buggy code) pairs: one, or several for a bug of several edits."""
    return list(zip(good, bad)) if isinstance(good, tuple) else [(good, bad)]


def apply(repo: Path, file: str, good, bad, what: str) -> None:
    """Plant one bug in the copy `repo`: each correct piece of code must be there exactly once."""
    path = repo / file
    text = path.read_text()
    for old, new in edits(good, bad):
        if text.count(old) != 1:
            raise SystemExit(f"{file}: expected exactly one {old!r} to plant '{what}' (the code changed?)")
        text = text.replace(old, new)
    path.write_text(text)


def plant(level: int, file: str, good, bad, what: str, pytest_args: list[str]) -> list[str]:
    """Apply one bug to a scratch copy, build, test; returns the ids of the tests that failed."""
    repo = scratch_copy()
    try:
        apply(repo, file, good, bad, what)
        targets = BUILDS.get(level, ())  # the level and the lab's libraries for it, as `make grade` builds them
        build = subprocess.run(["make", "-s", *targets, f"PYTHON={sys.executable}"] if targets else ["true"],
                               cwd=repo, capture_output=True, text=True)
        if build.returncode:
            raise SystemExit(f"planting '{what}' broke the build, so no test can judge it:\n{build.stderr}")
        test = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", f"level{level} and not notebooks",
             "-rf", *pytest_args], cwd=repo, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        failed = [line.split()[1] for line in test.stdout.splitlines() if line.startswith("FAILED")]
        if test.returncode < 0:  # a crash (a heap the bug overran, say) ends pytest before it reports: it catches too
            return failed + [crash(test.stderr, -test.returncode)]
        if test.returncode not in (0, 1) and not failed:  # (with failures, e.g. a GPU fault that stopped xdist: caught)
            raise SystemExit(f"pytest could not judge '{what}' (exit {test.returncode}):\n{test.stdout[-2000:]}")
        return failed
    finally:
        shutil.rmtree(repo.parent)


def crash(stderr: str, signal: int) -> str:
    """The test that was running when pytest died, from the stack faulthandler printed (innermost frame first)."""
    frames = re.findall(r'File "[^"]*/(tests/test_\w+\.py)", line \d+ in (test_\w+)', stderr)
    return f"{frames[0][0]}::{frames[0][1]} (pytest crashed: signal {signal})" if frames else \
        f"(pytest crashed: signal {signal}, in no test it could name)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="1,2,3,4,8", help="comma-separated levels whose bugs to plant")
    p.add_argument("--match", default="", help="only the bugs whose description contains this text")
    p.add_argument("--jobs", type=int, default=1, help="bugs planted at once, each in its own copy (on a GPU machine "
                   "of 16 cores: --jobs 2 -- -n 8)")
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = p.parse_args()
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    levels = {int(n) for n in args.levels.split(",")}
    bugs = [bug for bug in BUGS if bug[0] in levels and args.match in bug[4]]
    missed = 0
    with ThreadPoolExecutor(args.jobs) as pool:  # threads suffice: each waits on its own build and pytest
        verdicts = pool.map(lambda bug: plant(*bug, args.pytest_args), bugs)
        for (level, _, _, _, what), failed in zip(bugs, verdicts):  # printed in BUGS' order, each once it is known
            missed += not failed
            print(f"level {level}: {what}: {'CAUGHT by ' + str(len(failed)) + ' tests' if failed else 'NOT CAUGHT'}",
                  flush=True)
            for test in failed:
                print(f"    {test}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
