"""The engine image (Dockerfile, --target engine) on CPU: the built-in model's smoke test as the image's
non-root user without any network, what Triton needs to build its CUDA launcher on a GPU, and torch with
its CUDA libraries at the version CI tests with."""

import json
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
ENGINE_UID = 1000  # what the operator's pods run as (render.py's runAsUser)

# A Python extension module, compiled and loaded the way Triton builds its CUDA launcher on first use
# (triton/backends/nvidia/driver.py: compile_module_from_src, which needs gcc and Python.h).
LAUNCHER_PROBE = r"""
import textwrap
from triton.runtime.build import compile_module_from_src

source = textwrap.dedent('''
    #define PY_SSIZE_T_CLEAN
    #include <Python.h>
    static PyObject *add(PyObject *self, PyObject *args) {
        long a, b;
        if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
        return PyLong_FromLong(a + b);
    }
    static PyMethodDef methods[] = {{"add", add, METH_VARARGS, NULL}, {NULL, NULL, 0, NULL}};
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "launcher_probe", NULL, -1, methods};
    PyMODINIT_FUNC PyInit_launcher_probe(void) { return PyModule_Create(&module); }
''')
print(compile_module_from_src(source, "launcher_probe").add(40, 2))
"""

TORCH_PROBE = """
import json, torch
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version(), "nccl": torch.cuda.nccl.version()}))
"""


def test_runs_as_the_pods_user(run_image, engine_image):
    result = run_image(engine_image, "-c", "id -u; id -g; test -w $DDTREE_CACHE", options=("--entrypoint=sh",))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(ENGINE_UID), str(ENGINE_UID)]


def test_smoke_test_of_the_builtin_model_passes_offline(run_image, engine_image):
    """`ddtree smoke` of the built-in SmolLM2 with its built-in drafter: the image holds the weights, so no
    network at all (--network=none); they are converted into the cache as the image's user."""
    result = run_image(
        engine_image,
        "smoke",
        *("--model", "smollm2-135m-instruct", "--method", "ddtree", "--budget", "8", "--device", "cpu"),
        *("--batch-sizes", "1,2", "--max-new-tokens", "4", "--max-seq-len", "128"),
        options=("--network=none", "--env=OMP_NUM_THREADS=1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["mismatches"] == [], report


def test_triton_can_build_its_launcher(run_image, engine_image):
    result = run_image(engine_image, "-c", LAUNCHER_PROBE, options=("--entrypoint=python3",))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "42"


def test_torch_imports_with_its_cuda_libraries(run_image, engine_image):
    pinned = re.search(r"^torch==(\S+)$", (REPO / ".ci" / "constraints.txt").read_text(), re.M)
    assert pinned, "no torch pin in .ci/constraints.txt"
    result = run_image(engine_image, "-c", TORCH_PROBE, options=("--entrypoint=python3",))
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["version"].split("+")[0] == pinned.group(1), found
    # a CUDA build whose cuDNN and NCCL libraries load (from the nvidia-* wheels), not a CPU-only torch
    assert found["cuda"] and found["cudnn"] and found["nccl"], found
