"""gbs.lab: how the project studies itself. None of it is needed to run a grouped matmul.

* ``gbs.lab.bench`` / ``gbs.lab.peers``: ``python -m gbs bench``, our kernels' loaders, the output checks, read
  and MMA ceilings, and the torch / Triton peers the kernels are measured against;
* ``gbs.lab.timing``: CUDA-event timing with L2 rotation and host-bound retries, the streaming-read ceiling;
* ``gbs.lab.cases``: the benchmark's cases, synthetic problems of any size, a problem's useful FLOPs and bytes;
* ``gbs.lab.environment``: GPU, date, commit and versions recorded with every measured row;
* ``gbs.lab.perfmodel``: the analytic performance model (H200 measured, B200 from its datasheet);
* ``gbs.lab.sweep``: ``python -m gbs ablate``, the GPU config sweep that times every legal knob set, with
  ``gbs.lab.sweep_grid`` (its grids and work), ``gbs.lab.sweep_csv`` (part files and merging) and
  ``gbs.lab.sweep_report`` (modelled rows, calibration, dispatch tables, heatmaps);
* ``gbs.lab.ablation_data``: the rows of ``data/ablations.csv`` and the dispatch tables derived from them;
* ``gbs.lab.plotting``: the shared plot helpers of the notebooks and the sweep's figures;
* ``gbs.lab.ncu``: Nsight Compute exports: whole-kernel metrics of ours beside a peer's, and per-instruction
  counts cut into regions and shares;
* ``gbs.lab.report``: ``python -m gbs report``, the results tables of README.md and docs/results.md rendered
  from the bench CSVs of ``data/bench/``.

The lab imports the library (formats, layouts, problem, reference, dispatch, plan, kernels, api, interop);
the library never imports the lab. Only the CLI (``gbs/__main__.py``) reaches into it, for its
``bench``, ``ablate`` and ``report`` subcommands.
"""
