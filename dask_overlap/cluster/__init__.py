"""What makes clusters: the worker plugin, ``LocalGPUCluster``, CPU affinity, protocols
and UCX, the serializers of pinned and device blocks, and the ``dask overlap`` CLI.

Each module imports distributed; this package's ``__init__`` imports none of them, so
``import dask_overlap`` stays free of distributed's logging set-up.
"""
