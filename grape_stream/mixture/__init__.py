"""Static-mixture baselines of the GRAPE paper, as plain functions: CRISP (embedding importance sampling,
:mod:`.crisp`) and RegMix (regression over proxy runs, :mod:`.regmix`), plus multiple-choice scoring by
option log-likelihood (:mod:`.choice`). Each baseline yields a weight vector on the simplex that a recipe
uses directly (``algorithm.method=static``, ``algorithm.options.weights=[...]``) or that a GRAPE run starts
from (``algorithm.options.alpha0=[...]``). The proxy runner and the command line live in
:mod:`grape_stream.apps.mixture` (they need the recipe and the trainer)."""
