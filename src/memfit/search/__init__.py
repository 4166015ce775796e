"""Searching for settings by trial: probe, plan, fit and the lock that freezes the answer.

- :mod:`memfit.batch_search`: the batch-size search policy (pure, no torch);
- :mod:`memfit.search.probe`: ``probe``, the largest batch that fits and the one to use;
- :mod:`memfit.search.plan`: ``plan``, the fastest settings that reach a target batch, over
  :mod:`memfit.search.candidates` (the candidates, dominance, the Pareto front),
  :mod:`memfit.search.plan_trials` (running them, confirming fake trials on the device) and
  :mod:`memfit.search.plan_text` (the reason, the advice, why nothing fits);
- :mod:`memfit.search.lock`: ``memfit.lock``, written, read and checked;
- :mod:`memfit.search.fit`: ``fit``, doctor + estimate + probe + plan + lock + report.
"""
