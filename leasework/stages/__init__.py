"""The engine's own stages, in the order a poll walks them: schedule (due periodic tasks and
each family's due work), runs (claim, execute, settle), then each family's stages, then
maintenance. `App.stages()` assembles the list; a family adds its stages with `app.use(...)`.

A stage has a name, a per-poll limit, the NOTIFY payloads that wake it and one method doing one
bounded step that returns how many items it handled (workers/stage.py)."""
