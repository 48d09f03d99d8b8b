"""A run in its workdir: the plan worked out once per launch (`plan.RunPlan`), what `--dry_run`
prints of it (`dry_run`), and the record the launcher keeps there (`record`: file names,
revisions, history)."""
