"""Build the Cython core (kvshm._bitmap, kvshm._pool, kvshm._shmindex, kvshm._index,
kvshm._batch, kvshm.zmq_ctrl._zmqc, kvshm.cluster._hrw); metadata lives in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension("kvshm._bitmap", ["kvshm/_bitmap.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm._pool", ["kvshm/_pool.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm._shmindex", ["kvshm/_shmindex.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm._index", ["kvshm/_index.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm._batch", ["kvshm/_batch.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm._gcutil", ["kvshm/_gcutil.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm.zmq_ctrl._zmqc", ["kvshm/zmq_ctrl/_zmqc.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm.zmq_ctrl._zmtp", ["kvshm/zmq_ctrl/_zmtp.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm.zmq_ctrl._zmtpsrv", ["kvshm/zmq_ctrl/_zmtpsrv.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm.zmq_ctrl._fastpath", ["kvshm/zmq_ctrl/_fastpath.pyx"], extra_compile_args=["-O3"]),
    Extension("kvshm.zmq_ctrl._batchq", ["kvshm/zmq_ctrl/_batchq.pyx"], extra_compile_args=["-O3"]),
    # -ffp-contract=off: placement scores must round alike on every host (no fused multiply-add)
    Extension("kvshm.cluster._hrw", ["kvshm/cluster/_hrw.pyx"],
              extra_compile_args=["-O3", "-ffp-contract=off"]),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
