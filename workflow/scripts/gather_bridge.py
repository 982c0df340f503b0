import sys

sys.stderr = open(snakemake.log[0], "w")

from stagereplay.control_stages import gather_bridge

gather_bridge(list(snakemake.input.bridge), snakemake.output.bridge)
