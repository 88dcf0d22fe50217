"""What other tools run: configs and launch files for torchtitan, Megatron-LM and DeepSpeed (tools,
launch) and planning for the code that will train a plan (target)."""
