"""What runs on the client: the graphs that ``dask_overlap.map_blocks`` and
``dask_overlap.map_overlap`` build, and the pass that fuses them.

:mod:`.map_blocks` validates a call (:mod:`.checks`, dtypes by :mod:`.infer`) and lets
Dask build the graph with the user's function wrapped in a partition task, which
:mod:`.rewrite` turns into a partition layer (seeing through alias layers); :mod:`.batch`
joins small blocks into batches and cuts them back, where :mod:`.placement` says a device
will run them; :mod:`.map_overlap` and :mod:`.halo`
add halos. When Dask optimizes the graph, :mod:`.fusion` takes the steps around a
partition into it (:mod:`.steps` says which Dask layers can be steps, :mod:`.through`
fuses through a batch's cut-back). It knows of the worker side only the task it builds,
and nothing here touches a GPU. (This ``__init__`` imports nothing, so that each module
here keeps its own name: ``dask_overlap.map_blocks`` is :func:`.map_blocks.map_blocks`.)
"""
