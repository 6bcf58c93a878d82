from jaxrl.cli.main import app

app()
