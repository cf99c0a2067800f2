//! sluice-rls: a reference rate-limit service (Envoy's RLS v3) for sluice's
//! tests and demo. Not a product: see README.md.

// Errors are handled, never unwrapped, outside tests.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod config;
mod service;
mod store;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::config::Config;
use crate::service::{Service, Stats};
use crate::store::{MemoryStore, RedisStore, Store};

const USAGE: &str = "\
usage: sluice-rls --port PORT --config FILE [--store memory|redis] [--redis-url URL]
                  [--redis-timeout-ms MS] [--delay-ms MS] [--stats-port PORT]

Serves envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit (gRPC over
HTTP/2) on 127.0.0.1:PORT, counting in fixed windows as envoyproxy/ratelimit
does. A test and demo component, not a product.

  --port PORT            gRPC port on 127.0.0.1
  --config FILE          limits, JSON (see README.md)
  --store memory|redis   where counters live (default: memory)
  --redis-url URL        with --store redis, e.g. redis://127.0.0.1:6379
  --redis-timeout-ms MS  bound on each Redis connect and round trip (default 1000)
  --delay-ms MS          wait this long before answering each call (default 0)
  --stats-port PORT      HTTP/1 GET /stats on 127.0.0.1:PORT: calls, hits, ...
";

#[derive(Debug)]
struct Args {
    port: u16,
    config: String,
    store: String,
    redis_url: Option<String>,
    redis_timeout: Duration,
    delay: Duration,
    stats_port: Option<u16>,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut port = None;
    let mut config = None;
    let mut store = "memory".to_string();
    let mut redis_url = None;
    let mut redis_timeout = Duration::from_millis(1000);
    let mut delay = Duration::ZERO;
    let mut stats_port = None;
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag}: a value is missing"))?;
        let number = |v: &str| -> Result<u64, String> {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: {v:?} is not a number"))
        };
        let port_number = |v: &str| -> Result<u16, String> {
            v.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("{flag}: {v:?} is not a port"))
        };
        match flag.as_str() {
            "--port" => port = Some(port_number(&value)?),
            "--config" => config = Some(value),
            "--store" => store = value,
            "--redis-url" => redis_url = Some(value),
            "--redis-timeout-ms" => redis_timeout = Duration::from_millis(number(&value)?.max(1)),
            "--delay-ms" => delay = Duration::from_millis(number(&value)?),
            "--stats-port" => stats_port = Some(port_number(&value)?),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(Args {
        port: port.ok_or("--port is required")?,
        config: config.ok_or("--config is required")?,
        store,
        redis_url,
        redis_timeout,
        delay,
        stats_port,
    })
}

fn build_store(args: &Args) -> Result<Store, String> {
    match (args.store.as_str(), &args.redis_url) {
        ("memory", None) => Ok(Store::Memory(MemoryStore::default())),
        ("memory", Some(_)) => Err("--redis-url needs --store redis".into()),
        ("redis", Some(url)) => Ok(Store::Redis(RedisStore::new(url, args.redis_timeout)?)),
        ("redis", None) => Err("--store redis needs --redis-url".into()),
        (other, _) => Err(format!("--store: {other:?} is not memory or redis")),
    }
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("sluice-rls: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sluice-rls: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice-rls: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let text = std::fs::read_to_string(&args.config)
        .map_err(|e| format!("--config {}: {e}", args.config))?;
    let config = Config::parse(&text).map_err(|e| format!("--config {}: {e}", args.config))?;
    let store = build_store(&args)?;
    let stats = Arc::new(Stats::default());
    let domains = config.domain_count();
    let store_name = store.name();
    let service = Service {
        config,
        store,
        delay: args.delay,
        stats: stats.clone(),
    };

    // Bind both ports before announcing anything, so that a port in use is
    // reported at once and a stats port that answers means gRPC is bound.
    let grpc = TcpListener::bind(("127.0.0.1", args.port))
        .await
        .map_err(|e| format!("--port {}: {e}", args.port))?;
    if let Some(p) = args.stats_port {
        let listener = TcpListener::bind(("127.0.0.1", p))
            .await
            .map_err(|e| format!("--stats-port {p}: {e}"))?;
        tokio::spawn(serve_stats(listener, stats));
    }
    println!(
        "sluice-rls: listening on 127.0.0.1:{} (store {store_name}, {domains} domain(s), delay {} ms)",
        args.port,
        args.delay.as_millis()
    );

    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(service))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(grpc),
            shutdown(),
        )
        .await
        .map_err(|e| format!("gRPC server: {e}"))
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn serve_stats(listener: TcpListener, stats: Arc<Stats>) {
    loop {
        match listener.accept().await {
            Ok((conn, _)) => {
                tokio::spawn(answer_stats(conn, stats.clone()));
            }
            Err(e) => {
                eprintln!("sluice-rls: stats accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One HTTP/1 request per connection: `GET /stats` is the counters as
/// JSON, anything else a 404.
async fn answer_stats(mut conn: TcpStream, stats: Arc<Stats>) {
    let mut buf = Vec::with_capacity(1024);
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        true
    })
    .await;
    if read != Ok(true) {
        return;
    }
    let line = buf.split(|b| *b == b'\r').next().unwrap_or_default();
    let (status, body) = if line.starts_with(b"GET /stats ") {
        ("200 OK", stats.json())
    } else {
        (
            "404 Not Found",
            "{\"error\": \"GET /stats only\"}".to_string(),
        )
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(reply.as_bytes()).await;
    let _ = conn.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Result<Args, String> {
        parse_args(s.split_whitespace().map(String::from))
    }

    #[test]
    fn parses_and_refuses_arguments() {
        let a = args("--port 81 --config c.json --store redis --redis-url redis://x --delay-ms 50 --stats-port 82").unwrap();
        assert_eq!(
            (a.port, a.stats_port, a.delay),
            (81, Some(82), Duration::from_millis(50))
        );
        assert!(build_store(&a).is_ok());
        assert!(args("--config c.json")
            .unwrap_err()
            .contains("--port is required"));
        assert!(args("--port 0 --config c")
            .unwrap_err()
            .contains("not a port"));
        assert!(args("--port 1 --config c --delay-ms x")
            .unwrap_err()
            .contains("not a number"));
        assert!(args("--port 1 --config c --bogus 1")
            .unwrap_err()
            .contains("unknown option"));
        assert!(args("--port").unwrap_err().contains("missing"));
        assert_eq!(args("--help").unwrap_err(), "");
        let store = |s: &str| build_store(&args(s).unwrap()).map(|s| s.name());
        assert_eq!(store("--port 1 --config c"), Ok("memory"));
        assert!(store("--port 1 --config c --store redis").is_err());
        assert!(store("--port 1 --config c --redis-url redis://x").is_err());
        assert!(store("--port 1 --config c --store disk").is_err());
    }
}
