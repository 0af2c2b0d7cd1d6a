"""Pass 4, routes: how each transfer travels from its sender to its receivers.

``routes.py`` is the pass (:func:`plan_routes`, :class:`Routes`); its helpers, one per
way a transfer can travel besides directly: ``chain.py`` (``relay="chain"``: forwarded
along a chain of replicas), ``domain.py`` (``relay="domain"``: entering each relay run
at a balanced position), ``carry.py`` (carried by an NVLink neighbour through a relay
buffer).
"""

from .routes import Routes, plan_routes

__all__ = ["Routes", "plan_routes"]
