"""Planning: profiles (``profile``), the exact solver (``solving``) and the choice of what to serve (``selection``); pure data and math, no processes."""
