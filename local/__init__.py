"""kvferry.local: run the stack on one machine (control plane from Go modules, node agent, demo)."""
