"""What runs on the client: the graphs that ``dask_overlap.map_blocks`` builds.

:mod:`.map_blocks` validates a call and hands the graph to Dask with the user's function
wrapped in a partition task; around it, this package sees through alias layers
(:mod:`.aliases`) and infers dtypes (:mod:`.infer`). It knows of the worker side only the
task it builds, and nothing here touches a GPU. (This ``__init__`` imports nothing, so
that each module here keeps its own name: ``dask_overlap.map_blocks`` is
:func:`.map_blocks.map_blocks`.)
"""
