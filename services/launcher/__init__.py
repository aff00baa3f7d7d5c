"""The local stack: ``stack`` starts etcd (``etcd``), routers, workers and the gateway as child
processes on loopback that die with their parent (``process``), places workers on GPUs
(``placement``) and declares the worker options ``tandem serve`` and ``tandem bench`` share
(``options``)."""
