"""SGLang integration below the step: every SGLang internal (`sglang_adapter`), CPU stand-ins, the typed
configuration mapped from server arguments, the drafter's config checks and per-request refusals."""
