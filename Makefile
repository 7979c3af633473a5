# Two networks, seven levels. The two commands of the README:
#   make compare   set up, fetch MNIST, build and train every level this machine can run, print the table, plot
#   make test      the whole test suite
# Levels are listed once, in common/levels.py (asked below); here are only the build rules of the native ones.

PYTHON_VERSION_OK := $(shell python3 -c 'import sys; print(sys.version_info >= (3, 10))' 2>/dev/null)
VENV    := .venv
# A student edition (make lab) in the course's own folder uses the course's environment, once it is set up.
COURSE_ENV := $(and $(wildcard LAB_EDITION),$(wildcard ../common/levels.py),$(wildcard ../$(VENV)/.installed))
PYTHON  ?= $(if $(COURSE_ENV),../$(VENV)/bin/python,$(VENV)/bin/python)
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CFLAGS  := -O3 -march=native -std=c11 -Wall -Wextra -Wpedantic -Werror -fPIC
# Fat binary: machine code for A100 (sm_80) and H100/H200 (sm_90), plus PTX that newer GPUs compile at load.
CUDA_ARCH := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVFLAGS = -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC,-Wall,-Wextra -Werror all-warnings --shared
# The native levels this machine can build, and the lab's libraries for their tasks, as common/levels.py lists them:
# a C compiler's always, nvcc's where nvcc is.
ask_levels = $(shell python3 -m common.levels $(1) $(2))
CC_LEVELS := $(call ask_levels,targets,cc)
NVCC_LEVELS := $(if $(NVCC),$(call ask_levels,targets,nvcc))
GPU_MARKERS := $(call ask_levels,markers,gpu)
LAB_LIBS := $(call ask_levels,lab-libraries,cc) $(if $(NVCC),$(call ask_levels,lab-libraries,nvcc))

.PHONY: all compare bench infer test test-gpu check-memory check-memory-gpu levels $(CC_LEVELS) $(NVCC_LEVELS) level9 lab grade \
	gradebook chapters notebooks clean

all: compare

# ---- environment: a virtual environment with everything pyproject.toml lists ----
# torch is pinned first: 2.13.0 is a CPU build where a local wheel exists, and satisfies pyproject's range.
$(VENV)/.installed: pyproject.toml
	@[ "$(PYTHON_VERSION_OK)" = "True" ] || { echo "Python 3.10 or newer is needed as python3"; exit 1; }
	@echo "Setting up $(VENV) (once): PyTorch, NumPy, cffi, matplotlib, pytest and Jupyter from the package index,"
	@echo "about 2 GB and a few minutes (more where pip downloads PyTorch's CUDA build). Later runs reuse it."
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0 || $(VENV)/bin/pip install -q torch
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# nvcc without the toolkit's cuBLAS and cuDNN (as in CI): their wheels (cuDNN's: about 520 MB), so that levels 6 and 7
# build; installed only by the targets that build those levels.
$(VENV)/.cuda-installed: $(VENV)/.installed
	if [ -n "$(NVCC)" ] && [ ! -f "$(CUDA_HOME)/include/cublas_v2.h" ]; then $(VENV)/bin/pip install -q -e '.[cublas]'; fi
	if [ -n "$(NVCC)" ] && [ ! -f "$(CUDA_HOME)/include/cudnn.h" ]; then $(VENV)/bin/pip install -q -e '.[cudnn]'; fi
	touch $@

venv: $(VENV)/.installed
.PHONY: venv
# What the targets below depend on (defined before any rule names them: make expands a rule's prerequisites as it
# reads the rule). With PYTHON=python3 (the GPU machine) the targets use that interpreter as it is, without the venv.
ENV := $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV)/.installed)
CUDA_ENV := $(if $(ENV),$(VENV)/.cuda-installed)

# ---- native levels ----
# The headers and shared CUDA code every native level builds with (common/native), as make's dependencies.
INCLUDE := -Icommon/native
MLP_H   := common/native/mlp.h common/native/mlp_status.h
LENET_H := common/native/lenet.h $(MLP_H)
CUDA_MLP   := common/native/cuda_mlp.cuh $(MLP_H)
CUDA_LENET := common/native/cuda_lenet.cuh common/native/cuda_mlp.cuh $(LENET_H)

level4: level4_c/libmlp.so level4_c/liblenet.so
level4_c/libmlp.so: level4_c/mlp.c $(MLP_H)
	$(CC) $(CFLAGS) $(INCLUDE) -shared -o $@ $< -lm
# LeNet-5: lenet.c includes mlp.c, whose layer functions it reuses.
level4_c/liblenet.so: level4_c/lenet.c level4_c/mlp.c $(LENET_H)
	$(CC) $(CFLAGS) $(INCLUDE) -shared -o $@ $< -lm

level5: level5_cuda_naive/libmlp.so level5_cuda_naive/liblenet.so
level5_cuda_naive/libmlp.so: level5_cuda_naive/mlp.cu level5_cuda_naive/matmul.cuh $(CUDA_MLP)
	@[ -n "$(NVCC)" ] || { echo "level 5 needs nvcc (the CUDA toolkit)"; exit 1; }
	$(NVCC) $(NVFLAGS) $(INCLUDE) -o $@ $<
# LeNet-5: lenet.cu includes mlp.cu, whose kernels it reuses for the fully connected layers.
level5_cuda_naive/liblenet.so: level5_cuda_naive/lenet.cu level5_cuda_naive/mlp.cu level5_cuda_naive/matmul.cuh \
	$(CUDA_LENET)
	@[ -n "$(NVCC)" ] || { echo "level 5 needs nvcc (the CUDA toolkit)"; exit 1; }
	$(NVCC) $(NVFLAGS) $(INCLUDE) -o $@ $<

# cuBLAS: from the CUDA toolkit when it has it, else from the nvidia-cublas wheel (pip install -e '.[cublas]'),
# which ships libcublas.so.13 but no unversioned libcublas.so, hence -l: and an rpath to find it at run time.
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUBLAS_HOME ?= $(shell if [ -f $(CUDA_HOME)/include/cublas_v2.h ]; then echo $(CUDA_HOME); \
	else $(PYTHON) -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null; fi)
CUBLAS_LIB = $(firstword $(wildcard $(CUBLAS_HOME)/lib64/libcublas.so $(CUBLAS_HOME)/lib/libcublas.so.13))
# Levels 6 and 7 (level 7 includes level 6's file) link cuBLAS the same way: the recipe for both.
define build_with_cublas
	@[ -n "$(NVCC)" ] || { echo "$@ needs nvcc (the CUDA toolkit)"; exit 1; }
	@[ -n "$(CUBLAS_LIB)" ] || { echo "$@ needs cuBLAS: the CUDA toolkit's, or run: $(PYTHON) -m pip install -e '.[cublas]'"; exit 1; }
	$(NVCC) $(NVFLAGS) $(INCLUDE) -I$(CUBLAS_HOME)/include -o $@ $< \
		-L$(dir $(CUBLAS_LIB)) -l:$(notdir $(CUBLAS_LIB)) -Xlinker -rpath,$(dir $(CUBLAS_LIB))
endef
# cuDNN, for LeNet-5's convolutions at level 6: from the CUDA toolkit when it has it, else from the nvidia-cudnn-cu13
# wheel (pip install -e '.[cudnn]'), which, like cuBLAS's, ships libcudnn.so.9 but no unversioned libcudnn.so.
# Without cuDNN, level 6 builds the MLP's library only, and says so.
CUDNN_HOME ?= $(shell if [ -f $(CUDA_HOME)/include/cudnn.h ]; then echo $(CUDA_HOME); \
	else $(PYTHON) -c 'import nvidia.cudnn as c; print(list(c.__path__)[0])' 2>/dev/null; fi)
CUDNN_LIB = $(firstword $(wildcard $(CUDNN_HOME)/lib64/libcudnn.so $(CUDNN_HOME)/lib/libcudnn.so.9))
# Looked for when the recipe runs, after the environment's setup has installed the wheel.
# Levels 6 and 7 build LeNet-5's library where cuDNN is (level 7's includes level 6's), and say so where it is not.
define lenet_if_cudnn
	@if [ -n "$(CUDNN_LIB)" ]; then $(MAKE) --no-print-directory $(1); \
	else echo "note: $(1) (LeNet-5 at level $(2)) is not built: it needs cuDNN, the CUDA toolkit's" \
		"or the wheel's: $(PYTHON) -m pip install -e '.[cudnn]'"; fi
endef
define build_with_cudnn
	@[ -n "$(CUDNN_LIB)" ] || { echo "$@ needs cuDNN: the CUDA toolkit's, or run: $(PYTHON) -m pip install -e '.[cudnn]'"; exit 1; }
	$(build_with_cublas) -I$(CUDNN_HOME)/include -L$(dir $(CUDNN_LIB)) -l:$(notdir $(CUDNN_LIB)) \
		-Xlinker -rpath,$(dir $(CUDNN_LIB))
endef
LENET6_SOURCES := level6_cublas/lenet.cu level6_cublas/mlp.cu $(CUDA_LENET)
level6: level6_cublas/libmlp.so
	$(call lenet_if_cudnn,level6_cublas/liblenet.so,6)
level6_cublas/libmlp.so: level6_cublas/mlp.cu $(CUDA_MLP)
	$(build_with_cublas)
level6_cublas/liblenet.so: $(LENET6_SOURCES)
	$(build_with_cudnn)

level7: level7_fused/libmlp.so
	$(call lenet_if_cudnn,level7_fused/liblenet.so,7)
level7_fused/libmlp.so: level7_fused/mlp.cu level6_cublas/mlp.cu $(CUDA_MLP)
	$(build_with_cublas)
level7_fused/liblenet.so: level7_fused/lenet.cu $(LENET6_SOURCES)
	$(build_with_cudnn)
# Level 9 on GPUs: level 6's MLP and LeNet-5 with the gradients summed across GPUs between backward and update.
level9: level9_data_parallel/libmlp.so
	$(call lenet_if_cudnn,level9_data_parallel/liblenet.so,9)
level9_data_parallel/libmlp.so: level9_data_parallel/mlp.cu level9_data_parallel/gradient_sum.h level6_cublas/mlp.cu \
		$(CUDA_MLP)
	$(build_with_cublas)
level9_data_parallel/liblenet.so: level9_data_parallel/lenet.cu level9_data_parallel/gradient_sum.h $(LENET6_SOURCES)
	$(build_with_cudnn)
# Everything that links cuBLAS: after its wheel where the toolkit lacks it.
level6_cublas/libmlp.so level6_cublas/liblenet.so level7_fused/libmlp.so level7_fused/liblenet.so \
	level9_data_parallel/libmlp.so level9_data_parallel/liblenet.so \
	build/level7_stress.so build/level7_phases.so build/level7_floors.so build/lab_level7.so: | $(CUDA_ENV)

# Level 8's GPU backend: level 5's kernels (through its lenet.cu, which includes its mlp.cu) and level 6's cuBLAS.
level8: level8_framework/libops.so
level8_framework/libops.so: level8_framework/ops.cu common/native/ops.h level5_cuda_naive/lenet.cu \
		level5_cuda_naive/mlp.cu level6_cublas/mlp.cu $(CUDA_LENET)
	$(build_with_cublas)

# Level 7's testing and measuring builds: the race stress (tests/test_levels.py), the phase profile
# (common/harness/level7_phases.py), the floors of the exchange (common/harness/level7_floors.py).
build/level7_stress.so: NVFLAGS += -DFUSED_STRESS
build/level7_phases.so: NVFLAGS += -DFUSED_PROFILE
build/level7_stress.so build/level7_phases.so: level7_fused/mlp.cu level6_cublas/mlp.cu $(CUDA_MLP)
	@mkdir -p build
	$(build_with_cublas)
build/level7_floors.so: level7_fused/floors.cu level7_fused/mlp.cu level6_cublas/mlp.cu $(CUDA_MLP)
	@mkdir -p build
	$(build_with_cublas)

# The matrix products of levels 5 and 6 alone, for common/harness/matmul_kernels.py: one source, built with each level's
# mlp.cu (the level's folder on the include path).
build/matmul_level5.so: common/harness/matmul_kernels.cu level5_cuda_naive/mlp.cu level5_cuda_naive/matmul.cuh \
	$(CUDA_MLP)
	@[ -n "$(NVCC)" ] || { echo "$@ needs nvcc (the CUDA toolkit)"; exit 1; }
	@mkdir -p build
	$(NVCC) $(NVFLAGS) $(INCLUDE) -Ilevel5_cuda_naive -o $@ $<
build/matmul_level6.so: common/harness/matmul_kernels.cu level6_cublas/mlp.cu $(CUDA_MLP)
	@mkdir -p build
	$(build_with_cublas) -Ilevel6_cublas

# The lab's grader (common/classroom/grade.py, LABS.md) reaches each task's functions alone, through these: level 4's
# layer functions, its memory functions under ASan + UBSan, and on a GPU machine level 5's kernels and level 7's
# device code.
build/lab_level4.so: tests/lab_level4.c level4_c/lenet.c level4_c/mlp.c $(LENET_H)
	@mkdir -p build
	$(CC) $(CFLAGS) $(INCLUDE) -shared -o $@ $< -lm
build/lab_memory: tests/lab_memory.c level4_c/mlp.c $(MLP_H)
	@mkdir -p build
	$(CC) -g -O1 -std=c11 -Wall -Wextra -Werror -fsanitize=address,undefined -fno-sanitize-recover=all $(INCLUDE) \
		-o $@ $< -lm
build/lab_level5.so: tests/lab_level5.cu level5_cuda_naive/lenet.cu level5_cuda_naive/mlp.cu \
	level5_cuda_naive/matmul.cuh $(CUDA_LENET)
	@[ -n "$(NVCC)" ] || { echo "$@ needs nvcc (the CUDA toolkit)"; exit 1; }
	@mkdir -p build
	$(NVCC) $(NVFLAGS) $(INCLUDE) -o $@ $<
build/lab_level7.so: tests/lab_level7.cu level7_fused/mlp.cu level6_cublas/mlp.cu $(CUDA_MLP)
	@mkdir -p build
	$(build_with_cublas)

levels: $(CC_LEVELS) $(NVCC_LEVELS) $(if $(NVCC),level9)
# What the jobs that run the levels build: the CUDA levels (and cuBLAS's and cuDNN's wheels) only where a GPU is
# visible, since nowhere else can they run; `make levels` and the tests build them wherever nvcc is.
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
RUNNABLE_LEVELS := $(CC_LEVELS) $(if $(GPU),$(NVCC_LEVELS))

# ---- the main job and the tests ----
# What a grade of LEVEL needs: the CUDA libraries' wheels only for levels 6 and 7 (or every level).
GRADE_ENV := $(ENV) $(if $(filter 1 2 3 4 5,$(LEVEL)),,$(CUDA_ENV))

compare: $(ENV) $(RUNNABLE_LEVELS)
	$(PYTHON) -m common.harness.compare $(ARGS)

bench: $(ENV) $(RUNNABLE_LEVELS)
	$(PYTHON) -m common.harness.bench $(ARGS)

# LeNet-5 served from a PyTorch state_dict by the GPU levels, checked against PyTorch and timed (a GPU machine).
infer: $(ENV) levels
	$(PYTHON) -m common.harness.serving $(ARGS)

test: $(ENV) levels $(LAB_LIBS)
	$(PYTHON) -m pytest $(ARGS)

# On the GPU machine: the tests that run on the GPU (marked gpu; `make test` runs every other one), none of them
# skipped, with its own python3 (PyTorch with CUDA), no virtual environment, no network (so not the tests that fetch
# from PyPI). With pytest-xdist, a worker per core (the chapter's lockstep on one, its free runs on another), each
# with BLAS and OpenMP on one thread: several workers' thread pools, spinning while they wait, would only fight over
# the cores. It ends with where the time went.
XDIST = $(shell python3 -c 'import xdist' 2>/dev/null && printf '%s' '-n auto --dist loadgroup')
ONE_THREAD := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
test-gpu:
	$(MAKE) -j8 levels $(LAB_LIBS) PYTHON=python3
	$(ONE_THREAD) python3 -m pytest --require-gpu -m "gpu and not pypi" $(XDIST) --durations=25 $(ARGS)

# The level-4 library driven from C under valgrind (leaks, invalid reads and writes) and under ASan + UBSan.
check-memory: level4
	mkdir -p build
	$(CC) -g -O1 -std=c11 -Wall -Wextra $(INCLUDE) -o build/check_memory tests/check_memory.c level4_c/mlp.c -lm
	valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=all build/check_memory
	$(CC) -g -O1 -std=c11 -Wall -Wextra -fsanitize=address,undefined -fno-sanitize-recover=all $(INCLUDE) \
		-o build/check_memory_asan tests/check_memory.c level4_c/mlp.c -lm
	build/check_memory_asan

# On the GPU machine: the level-5 and level-6 tests under compute-sanitizer memcheck, device leaks included.
# --show-backtrace no: with backtraces, the sanitizer keeps the Python frames of every allocation alive,
# and with them the models, which it then reports as leaked at exit. The tests' own memcheck test is left
# out: it starts a compute-sanitizer of its own, which cannot run inside this one.
check-memory-gpu:
	$(MAKE) levels $(LAB_LIBS) PYTHON=python3
	compute-sanitizer --tool memcheck --leak-check full --show-backtrace no --error-exitcode 1 \
		python3 -m pytest -q --require-gpu -m "($(GPU_MARKERS)) and not notebooks" -k "not memcheck" $(ARGS)

# ---- the classroom labs (LABS.md) ----
# The student edition in lab/: the marked solutions replaced by stubs, a LAB.md per level. Needs python3 and git only.
lab:
	python3 -m common.classroom.lab

# Grade every attempted task: one table, grade.json. LEVEL=4 grades one level, TASK=4.2 one task; ARGS=-v shows why
# each check fails.
grade: $(GRADE_ENV)
	$(PYTHON) -m common.classroom.grade $(if $(LEVEL),--level $(LEVEL)) $(if $(TASK),--task $(TASK)) $(ARGS)

# The chapters executed and committed with their outputs (common/book/make.py): those whose outputs are stale, on this
# machine, the GPU levels' ones only where there is a GPU. ARGS=--all re-makes every one; ARGS=--check only lists.
chapters: $(ENV) levels
	$(PYTHON) -m common.book.make $(ARGS)

# A class's grades (LABS.md): every submission in SUBMISSIONS (one folder per student) graded in parallel, each in
# bubblewrap sandboxes (it refuses to run without bwrap; ARGS=--trust-submissions for your own code), with the
# held-out checks; one CSV, a summary and a plot in gradebook/. JOBS=n at once, LEVEL=n one level (and only what it
# needs: each submission is built in its own sandbox, none of this repository's levels), TASK=n.m one task.
gradebook: $(GRADE_ENV)
	@[ -n "$(SUBMISSIONS)" ] || { echo "usage: make gradebook SUBMISSIONS=folder (one folder per student)"; exit 1; }
	$(PYTHON) -m common.classroom.gradebook $(SUBMISSIONS) $(if $(JOBS),--jobs $(JOBS)) $(if $(LEVEL),--level $(LEVEL)) \
		$(if $(TASK),--task $(TASK)) $(ARGS)

# The kernels import this folder's modules first (a chapter runs in its level's folder): an edition using the course's
# environment runs its own code, not the course's.
notebooks: $(ENV) levels
	PYTHONPATH=$(CURDIR) $(PYTHON) -m jupyter lab

clean:
	rm -rf level*/lib*.so build
