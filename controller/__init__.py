"""Control plane: configuration, Ray placement, request routing, migration and pool scaling (no fronts, no
planner: ``frontend`` serves it, ``planner`` reads it)."""
