package main

// GET /metrics: the service's metrics in Prometheus' text format (client_golang), behind the API
// key unless -metrics-public (auth.go). What is measured here, per request:
//
//   - pipe_serve_requests_total{endpoint, code}: every request, by its route (the path of the
//     pattern it matched, "other" for none) and its response's status. A stream that fails after
//     its 200 was sent counts as 200: pipe_serve_sequences_finished_total{reason="error"} and
//     pipe_serve_write_failures_total say what became of it;
//   - pipe_serve_request_duration_seconds{endpoint}: from the request's start to the handler's
//     end (a stream's last event);
//   - pipe_serve_time_to_first_token_seconds: from the request's start (its body read, the prompt
//     tokenized and queued for a slot included) to its first token leaving the generator;
//   - pipe_serve_inter_token_seconds: between two tokens of one completion as the service receives
//     them (a completion of n tokens gives n-1 observations);
//   - pipe_serve_prompt_tokens_total and pipe_serve_generated_tokens_total: the usage the
//     responses report (prompt_tokens, completion_tokens), counted for every request admitted
//     into the generator, whether or not its client stayed.
//
// And read when scraped (statsCollector): the generator's state and statistics (slots, queue,
// steps, sampling time) and each stage's (busy and idle time, micro-batches, failures, queue);
// the service's own counters of /health; whether the pipeline works (pipe_serve_pipeline_up) and
// how often it was rebuilt after breaking (faults.go). A rebuilt pipeline's generator counts from
// zero again, which Prometheus' rate() takes as a counter reset; while the pipeline is broken
// its generator's statistics are left out. A step is one micro-batch on every stage, so a stage's
// mean step time is rate(busy) / rate(micro-batches), and its busy fraction rate(busy) /
// (rate(busy) + rate(idle)): counters let Prometheus compute both over any window, where a
// gauge of the average since start would hide a change.

import (
	"log"
	"net/http"
	"strconv"
	"strings"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are the service's collectors, in a registry of its own (not client_golang's global
// one, which packages may fill behind its back).
type metrics struct {
	registry        *prometheus.Registry
	requests        *prometheus.CounterVec
	duration        *prometheus.HistogramVec
	firstToken      prometheus.Histogram
	interToken      prometheus.Histogram
	promptTokens    prometheus.Counter
	generatedTokens prometheus.Counter
}

func newMetrics(s *server) *metrics {
	m := &metrics{
		registry: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pipe_serve_requests_total",
			Help: "HTTP requests by endpoint (the route's path, other for none) and status code."},
			[]string{"endpoint", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "pipe_serve_request_duration_seconds",
			Help:    "Time from a request's start to its response's end (a stream's last event), by endpoint.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}},
			[]string{"endpoint"}),
		firstToken: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "pipe_serve_time_to_first_token_seconds",
			Help:    "Time from a completion request's start to its first token (queueing and prefill included).",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}}),
		interToken: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "pipe_serve_inter_token_seconds",
			Help:    "Time between two consecutive tokens of one completion.",
			Buckets: []float64{.001, .0025, .005, .01, .02, .035, .05, .075, .1, .25, .5, 1, 2.5}}),
		promptTokens: prometheus.NewCounter(prometheus.CounterOpts{Name: "pipe_serve_prompt_tokens_total",
			Help: "Prompt tokens of the requests admitted into the generator (usage.prompt_tokens)."}),
		generatedTokens: prometheus.NewCounter(prometheus.CounterOpts{Name: "pipe_serve_generated_tokens_total",
			Help: "Tokens generated for the requests' completions (usage.completion_tokens)."}),
	}
	m.registry.MustRegister(m.requests, m.duration, m.firstToken, m.interToken, m.promptTokens, m.generatedTokens,
		newStatsCollector(s),
		// The process (memory, descriptors: what -max-conns bounds) and the Go runtime.
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), collectors.NewGoCollector())
	return m
}

// handler serves the registry. A collector that fails (the generator's statistics, once it is
// closed) is logged and left out, so that the rest is still scraped.
func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{ErrorLog: log.Default(),
		ErrorHandling: promhttp.ContinueOnError})
}

// instrument counts and times every request that reaches mux's handler, the refused ones (401)
// included: the endpoint is the path of the pattern mux routes the request to, so that the
// label takes only the routes' values whatever paths clients ask for.
func (m *metrics) instrument(mux *http.ServeMux, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		began := time.Now()
		endpoint := "other"
		if _, pattern := mux.Handler(r); pattern != "" {
			_, path, _ := strings.Cut(pattern, " ") // "POST /v1/completions" → "/v1/completions"
			endpoint = path
		}
		sw := &statusWriter{ResponseWriter: w}
		next.ServeHTTP(sw, r)
		code := sw.code
		if code == 0 {
			code = http.StatusOK // what net/http sends for a handler that wrote nothing
		}
		m.requests.WithLabelValues(endpoint, strconv.Itoa(code)).Inc()
		m.duration.WithLabelValues(endpoint).Observe(time.Since(began).Seconds())
	})
}

// statusWriter records the status a handler sends.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(p []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	return s.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the flush and deadline controls underneath
// (limits.go's deadlineWriter).
func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// tokenClock times one completion's tokens: the first from the request's start, each next from
// the one before.
type tokenClock struct {
	m           *metrics
	began, last time.Time
}

func (m *metrics) clock(began time.Time) *tokenClock { return &tokenClock{m: m, began: began} }

// token observes a token that arrived at at.
func (c *tokenClock) token(at time.Time) {
	if c.last.IsZero() {
		c.m.firstToken.Observe(at.Sub(c.began).Seconds())
	} else {
		c.m.interToken.Observe(at.Sub(c.last).Seconds())
	}
	c.last = at
}

// usage counts a completion's tokens as its response reports them.
func (m *metrics) usage(promptTokens, completionTokens int) {
	m.promptTokens.Add(float64(promptTokens))
	m.generatedTokens.Add(float64(completionTokens))
}

// statsCollector reads, when scraped, the generator's statistics, each stage's, and the
// service's counters that /health shows.
type statsCollector struct {
	s *server

	slots, slotsInUse, queued, steps, stepsInFlight, rowsPerStep, sampling, sequences *prometheus.Desc
	cachedPromptTokens                                                                *prometheus.Desc
	stageBusy, stageIdle, stageMicrobatches, stageFailures, stageQueue                *prometheus.Desc
	finished, disconnects, writeFailures, queueTimeouts                               *prometheus.Desc
	pipelineUp, rebuilds                                                              *prometheus.Desc
}

func newStatsCollector(s *server) *statsCollector {
	desc := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("pipe_serve_"+name, help, labels, nil)
	}
	return &statsCollector{
		s:             s,
		slots:         desc("slots", "KV-cache slots: sequences that can be generated at once."),
		slotsInUse:    desc("slots_in_use", "Sequences holding a cache slot now."),
		queued:        desc("queue_depth", "Sequences waiting for a cache slot now."),
		steps:         desc("generator_steps_total", "Steps the generator ran through the pipeline."),
		stepsInFlight: desc("generator_steps_in_flight", "Steps the generator lets into the pipeline at once now."),
		rowsPerStep: desc("generator_rows_per_step_mean",
			"Sequences per step, averaged over the steps since the service started."),
		sampling:  desc("generator_sampling_seconds_total", "Time the generator spent sampling, all steps together."),
		sequences: desc("generator_sequences_finished_total", "Sequences the generator ended, for any reason."),
		cachedPromptTokens: desc("generator_cached_prompt_tokens_total",
			"Prompt tokens found in cache slots (prefix reuse) instead of computed: the prefix cache's hits, in tokens."),
		stageBusy: desc("stage_busy_seconds_total", "Time a stage spent running steps.", "stage"),
		stageIdle: desc("stage_idle_seconds_total", "Time a stage spent waiting for a step.", "stage"),
		stageMicrobatches: desc("stage_microbatches_total",
			"Micro-batches a stage ran (one per step), failed ones included.", "stage"),
		stageFailures: desc("stage_failures_total", "Micro-batches whose stage code raised.", "stage"),
		stageQueue:    desc("stage_queue_depth", "Micro-batches waiting for a stage now.", "stage"),
		finished: desc("sequences_finished_total",
			"Completions of this service by how they ended: stop, length, cancelled, deadline, error, other.", "reason"),
		disconnects: desc("client_disconnects_total", "Clients that left before their completion ended."),
		writeFailures: desc("write_failures_total",
			"Responses cut off: the client stopped reading for -write-timeout, or left."),
		queueTimeouts: desc("queue_timeouts_total", "Requests that waited past -queue-timeout for a slot (503)."),
		pipelineUp:    desc("pipeline_up", "1 while the pipeline works, 0 from its failure until it is rebuilt."),
		rebuilds: desc("pipeline_rebuilds_total",
			"Times the pipeline was rebuilt, with fresh worker processes, after one failed."),
	}
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.slots, c.slotsInUse, c.queued, c.steps, c.stepsInFlight, c.rowsPerStep,
		c.sampling, c.sequences, c.cachedPromptTokens, c.stageBusy, c.stageIdle, c.stageMicrobatches, c.stageFailures, c.stageQueue,
		c.finished, c.disconnects, c.writeFailures, c.queueTimeouts, c.pipelineUp, c.rebuilds} {
		ch <- d
	}
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for reason := pipe.FinishStop; reason <= pipe.FinishError; reason++ {
		counter(c.finished, float64(s.finished[reason].Load()), reason.String())
	}
	counter(c.finished, float64(s.finishedOther.Load()), "other")
	counter(c.disconnects, float64(s.disconnects.Load()))
	counter(c.writeFailures, float64(s.writeFailures.Load()))
	counter(c.queueTimeouts, float64(s.queueTimeouts.Load()))

	counter(c.rebuilds, float64(s.pipeline.rebuilds.Load()))
	gauge(c.slots, float64(s.info.Slots))
	b := s.pipeline.acquire()
	up := 0.0
	if b != nil && b.unhealthy() == nil {
		up = 1
	}
	gauge(c.pipelineUp, up)
	if b == nil {
		return // broken: no generator to read until it is rebuilt
	}
	st, err := b.gen.Stats()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.slotsInUse, err)
		return
	}
	gauge(c.slotsInUse, float64(st.SlotsInUse))
	gauge(c.queued, float64(st.Queued))
	counter(c.steps, float64(st.Steps))
	gauge(c.stepsInFlight, float64(st.StepsInFlight))
	gauge(c.rowsPerStep, st.MeanRowsPerStep)
	counter(c.sampling, st.Sampling.Seconds())
	counter(c.sequences, float64(st.SequencesFinished))
	counter(c.cachedPromptTokens, float64(st.CachedPromptTokens))
	for i := range s.stages {
		stage := strconv.Itoa(i)
		ss, err := b.gen.StageStats(i)
		if err != nil {
			ch <- prometheus.NewInvalidMetric(c.stageBusy, err)
			return
		}
		counter(c.stageBusy, ss.Busy.Seconds(), stage)
		counter(c.stageIdle, ss.Idle.Seconds(), stage)
		counter(c.stageMicrobatches, float64(ss.Microbatches), stage)
		counter(c.stageFailures, float64(ss.Failures), stage)
		gauge(c.stageQueue, float64(ss.QueueDepth), stage)
	}
}
