from jaxrl.cli import app

app()
