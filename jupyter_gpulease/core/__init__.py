"""The pure domain: model, placement, scheduler and policy. No I/O, no clock of its own."""
