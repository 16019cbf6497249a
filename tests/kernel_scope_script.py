"""The scope of the __main__ kernel guard, on a machine with no GPU: run as a script.

A stand-in ``cupy`` module whose ``ElementwiseKernel`` counts its copies (an unpickled copy
is what breaks the original on a GPU; see dask_overlap.backends.kernel_pickling) is put in
``sys.modules`` before dask_overlap is imported. Prints one ``name=value`` line per check.
"""

from __future__ import annotations

import copy
import copyreg
import pickle
import sys
import types

import dask
import dask.array as da  # (before the stand-in: Dask registers CuPy's types if it sees one)
import numpy as np

cupy = types.ModuleType("cupy")


class Counted:
    """A stand-in that counts the objects made of its class: an unpickled copy is one more
    (CuPy's own pickle them by value)."""

    made = 0

    def __init__(self, *args: str):
        self.args = args
        type(self).made += 1

    def __reduce__(self):
        return type(self), self.args


class ElementwiseKernel(Counted):
    def __call__(self, b):
        return b * 2 + 1


class ufunc(Counted):  # as CuPy's: named after its place (cupy_negative is cupy.negative)
    def __init__(self, name: str):
        super().__init__(name)
        self.__name__ = name

    def __call__(self, b):
        return -b


class Module(Counted):  # a compiled module, which CuPy pickles by value (its handle)
    pass


ElementwiseKernel.__module__ = ufunc.__module__ = "cupy"
cupy.ElementwiseKernel = ElementwiseKernel
cupy.ufunc = ufunc
cupy.negative = ufunc("cupy_negative")
cupy_cuda = types.ModuleType("cupy.cuda")
cupy.cuda = cupy_cuda.function = types.ModuleType("cupy.cuda.function")
cupy_cuda.function.Module = Module
Module.__module__ = "cupy.cuda.function"
sys.modules.update({"cupy": cupy, "cupy.cuda": cupy_cuda, "cupy.cuda.function": cupy_cuda.function})

import dask_overlap  # noqa: E402
from dask_overlap.backends.kernel_pickling import kernels_by_reference  # noqa: E402

twice_plus_one = ElementwiseKernel("twice_plus_one")  # a kernel of __main__, as users write


def func(b):
    return twice_plus_one(b)


def main() -> None:
    x = da.from_array(np.arange(64.0).reshape(8, 8), chunks=(4, 8))
    before = ElementwiseKernel.made
    y = dask_overlap.map_blocks(func, x, split_axis=0)
    print(f"copies_while_building={ElementwiseKernel.made - before}")
    print(f"copyreg_after={ElementwiseKernel in copyreg.dispatch_table}")
    task = next(v for v, i in y.dask.layers[y.name].indices if i is None and callable(v))
    before = ElementwiseKernel.made
    dask.base.tokenize(task)
    back = pickle.loads(pickle.dumps(task))
    copied = copy.copy(task)
    print(f"copies_by_task={ElementwiseKernel.made - before}")
    print(f"same_kernel={back.func.__globals__['twice_plus_one'] is twice_plus_one}")
    print(f"copy_shares_func={copied.func is task.func}")
    print(f"plain_pickle_copies={pickle.loads(pickle.dumps(twice_plus_one)) is not twice_plus_one}")
    before = ElementwiseKernel.made
    dask.base.tokenize(func, "outside")  # Dask's own tokenize, outside the guard: copies
    print(f"copies_by_plain_tokenize={ElementwiseKernel.made - before}")
    # A ufunc CuPy publishes pickles by name (any process finds it); one of the user's own,
    # and a compiled module, as a reference. copyreg is left as it was.
    made = ufunc.made
    negated = dask_overlap.map_blocks(cupy.negative, x, split_axis=0)
    dask.base.tokenize(negated)
    print(f"ufunc_copies={ufunc.made - made}")
    own, module = ufunc("my_ufunc"), Module()
    modules = Module.made
    with kernels_by_reference():
        by_name = pickle.dumps(cupy.negative)
        same = [pickle.loads(by_name) is cupy.negative]
        same += [pickle.loads(pickle.dumps(o)) is o for o in (own, module)]
    print(f"ufunc_by_name={b'negative' in by_name and b'cupy_negative' not in by_name}")
    print(f"same_ufunc_and_module={all(same) and Module.made == modules}")
    print(f"copyreg_after_all={any(t in copyreg.dispatch_table for t in (ufunc, Module))}")
    got = negated.compute(scheduler="threads")
    print(f"ufunc_correct={bool(np.array_equal(got, -np.arange(64.0).reshape(8, 8)))}")
    got = y.compute(scheduler="threads")
    print(f"correct={bool(np.array_equal(got, np.arange(64.0).reshape(8, 8) * 2 + 1))}")


if __name__ == "__main__":
    main()
