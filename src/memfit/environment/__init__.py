"""The machine: facts (NVML, nvidia-smi, conda, torch), doctor's checks, environment files."""
