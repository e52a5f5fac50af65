FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
COPY pyproject.toml ./
COPY . .
# GPU images install the CUDA build of torch that matches the host driver before this line.
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir -e .
RUN DJANGO_SETTINGS_MODULE=opentinker_site.settings.production SECRET_KEY=build \
    OPENTINKER_KEY_HMAC_SECRET=build DATABASE_URL=sqlite:////tmp/build.sqlite3 \
    REDIS_URL=redis://localhost:6379/0 python manage.py collectstatic --noinput
EXPOSE 8000
CMD ["gunicorn", "opentinker_site.wsgi:application", "--config", "python:opentinker_site.gunicorn_conf", "--bind", "0.0.0.0:8000"]
