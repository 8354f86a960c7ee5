"""Planning: the pipeline every face calls.

The faces hand it one `options.PlanOptions` (checked once) and the `options.TrainingStep` it is for.
`pipeline.plan_with_dtypes` captures every graph (`planner`, `graph_calls`), chooses the loss region's chunk count
(`loss_region`) and the dtypes (`precision_plan`, `precision_auto`), solves under the one budget
(`budget`), compiles (`compilers`), verifies on a real step, and returns a `Plan` (`plan`, cached by
`cache`).
`step_planner` and `step_window` plan the torch.compile backend's steps as they run. Imports every stage
below it; no stage below imports it.
"""
