"""What every process of the product is made of, below the data flow: options, structured logs,
errors carrying their exit code, the command-line scaffold. Imports nothing else of the
product; every stage, and the pipeline, may import it."""
