"""Tools around the product, used only by scripts/ and tests/: they import no Ray, and no product package
imports them (both are import-linter contracts in pyproject.toml).

- ``tools.loadgen``: the HTTP load generator of the reliability suite and ``scripts/soak.py``.
- ``tools.serve_config``: renders the Serve configs in cluster/launch/ (``scripts/render_serve_config.py``).
- ``tools.k8s_manifests``: renders and validates the KubeRay manifests in k8s/ (``scripts/render_k8s.py``).
- ``tools.hostlab``: network-namespace hosts with their own address and sshd on one machine, for multi-host
  tests (``scripts/hostlab.py``, ``tests/lab``).

Checking a Serve config against Ray Serve's own schema needs Ray, so ``validate_serve_config`` lives in
``deployments.serve_schema``; ``tools.k8s_manifests.validate_manifest`` takes it as an argument.
"""
