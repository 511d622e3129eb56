"""Files that external tools load by *path*, kept in a directory of their own.

polygraphy imports a ``--data-loader-script`` / ``--trt-network-postprocess-script`` file as a
top-level module, with the file's directory first on ``sys.path`` while it does. From
``specdec/export/`` itself that would let ``onnx.py`` and ``tensorrt.py`` there stand in for
the real ``onnx`` and ``tensorrt`` packages; this directory holds nothing that can shadow a
package.
"""
