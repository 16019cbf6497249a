"""What runs on a worker: the runtime that owns the pools, and the partition runner.

A partition task (built on the client by :mod:`dask_overlap.graph`) runs on a worker
through this process's :class:`~.runtime.Runtime` (:mod:`.current` says which): the
runner (:mod:`.partition`) lays the partition out in sub-chunks (:mod:`.layout`), admits
them into the pinned ring (:mod:`.subchunks`), drives the pure engine (:mod:`.engine`)
and hands its actions to the backend's streams and the copy threads (:mod:`.copies`);
results land in the partition's output (:mod:`.output`), checked (:mod:`.results`), and
the work is counted (:mod:`.stats`, :mod:`.meter`, :mod:`.sampling`). Nothing here
imports the graph side or the cluster side.
"""
