// The UDP transport's tunables, each with why it has its value. The
// measurements behind them are in bench/NOTES.md ("The UDP transport's
// tunables").
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace softverbs::udp::parameters {

// ---- the reliable protocol ------------------------------------------------------

// Request bytes one RC QP may have unacknowledged: 512 packets at path MTU
// 4096. The window is counted in PSNs, so a smaller path MTU gets more of
// them (window_packets): 256 packets of 1 KiB held a veth of MTU 1500 to a
// quarter of its raw UDP throughput, and 1 MiB in flight to half of what 2
// MiB gets there. Go-back-N resends all of them after a loss, so more than
// the receive buffers hold only costs.
inline constexpr size_t kWindowBytes = 2 << 20;
// ...and at most this many PSNs (a path MTU of 256 or 512): every packet
// costs the receive buffer its own skb (~2 KiB of truesize at 1 KiB).
inline constexpr int32_t kMaxWindow = 2048;
// A responder ACKs at least this often even if no packet asks.
inline constexpr uint32_t kAckEveryPackets = 32;
// Request bytes in flight that a process's RC QPs share (PortEngine::window):
// each QP with requests outstanding gets an equal share, a power of two of
// packets between kMinWindow and window_packets(mtu). 64 QPs with a full
// window each put 64 MiB in flight, which waited in the peer's socket queues
// longer than the ACK timeout on a loaded machine: the timers fired while
// nothing was lost, go-back-N doubled the queue, and retry counts ran out
// against a live peer. 16 MiB drains in ~30 ms at 0.5 GB/s; 4 MiB cost 64 QPs
// a fifth of their throughput (more ACKs asked for, bench/NOTES.md).
inline constexpr size_t kInFlightBytes = 16 << 20;
// No share is smaller: the responder ACKs every kAckEveryPackets packets even
// without an AckReq, so a window this large never waits on an ACK nobody sends.
inline constexpr int32_t kMinWindow = kAckEveryPackets;
// The PSNs an RC QP of this path MTU may have unacknowledged when it has
// the port to itself: kWindowBytes of them, within kMinWindow..kMaxWindow.
constexpr int32_t window_packets(uint32_t mtu) {
  const size_t packets = kWindowBytes / (mtu < 256 ? 256 : mtu);
  return static_cast<int32_t>(packets < kMinWindow ? kMinWindow : packets > kMaxWindow ? kMaxWindow : packets);
}
static_assert(window_packets(4096) == 512 && window_packets(1024) == 2048 && window_packets(256) == kMaxWindow);
// READ and atomic requests remembered (at least max_dest_rd_atomic), so that
// a duplicate is answered again, as IBA 9.7.5.1.4 asks.
inline constexpr size_t kReplayEntries = 64;

// ---- ACKs and receives -------------------------------------------------------------

// An ACK may wait this long to leave with its QP's next request: far below
// the retransmission timer's 1 ms floor.
inline constexpr auto kAckHold = std::chrono::microseconds(10);
// A QP whose application answers quickly holds ACKs for twice its last
// answer's time, up to this: an ACK that leaves alone lets the peer stop
// polling before the answer comes.
inline constexpr auto kMaxAckHold = std::chrono::microseconds(100);
// An RC SEND that finds no receive waits this long for one if it may answer
// a request the application has not yet acted on: an HCA's ACK comes a round
// trip later than ours, and the receive is usually on its way. Below the
// retransmission timer, so that a waiting SEND is not resent.
inline constexpr auto kReceiveGrace = std::chrono::microseconds(500);
// Packets that may wait behind such a SEND; past this the sender gets the
// RNR NAK at once. A whole window: a sender within it never loses the grace.
inline constexpr size_t kMaxAwaitingPackets = kMaxWindow;

// ---- who does the work: the application's calls or the io thread -----------------

// After this long without a verbs call the io thread takes over; the wait
// doubles up to kAppIdleAfter while the application keeps calling, so that
// a polling application costs a wake-up per 500 us and one that stops
// calling waits ~20 us.
inline constexpr auto kAppIdleAfterFirst = std::chrono::microseconds(20);
inline constexpr auto kAppIdleAfter = std::chrono::microseconds(500);
// A CQ event kept for the next ibv_get_cq_event on its channel (see
// PortEngine::pending_events_) goes out as a datagram after this, at the
// application's next verbs call: another thread may wait on the channel.
inline constexpr auto kPendingEventHold = std::chrono::microseconds(50);
// Posts this close together with no poll between are a burst: their packets
// wait in the send batch for the next post to join (one sendmsg for many).
inline constexpr auto kBurstGap = std::chrono::microseconds(10);
// After this many polls in a row that were followed by bursts, the first
// post after a poll waits for the rest of its burst too.
inline constexpr uint32_t kBurstsBeforeFirstPostWaits = 4;
// A signaled request posted after this many unsignaled ones does not wait
// in a burst's batch: the application polls for its completion, and the
// peer can work on what went before while the rest of the burst is posted
// (ib_write_bw signals one in 100). A program that signals every request
// polls for them as they come, and its bursts keep their batches.
inline constexpr uint32_t kUnsignaledBeforeSignaledLeaves = 16;
// A poll leaves a burst's batch of fewer than kHeldBatchPackets waiting for
// more posts (for at most kBurstGap) while its QP has this many packets
// unacknowledged: they bring ACKs, completions and so more posts. Sent at
// once, a few packets are answered by an ACK of their own, whose few
// completions bring a few posts again (ib_write_bw -Q 1 at a fifth of its rate).
inline constexpr uint32_t kPacketsInFlightToHold = 32;
inline constexpr uint32_t kHeldBatchPackets = 16;
// When a burst's packets had to be sent by the io thread (the program spins
// on memory instead of calling), batching pauses this long, doubling up to
// kDeferralPause each time it happens again.
inline constexpr auto kFirstDeferralPause = std::chrono::milliseconds(1);
inline constexpr auto kDeferralPause = std::chrono::milliseconds(100);
// How long a flow whose source port another program holds leaves from port
// 4791 before its port is tried again (see PortEngine::send_socket).
inline constexpr auto kHeldPortRetry = std::chrono::seconds(1);
// Deadlines at least this far off are armed by whichever thread finds them;
// nearer ones reprogram the CPU's timer (a hypervisor trap) and are left to
// the io thread.
inline constexpr auto kArmedFromAnyThread = std::chrono::milliseconds(5);
// After answering a READ or an atomic (or an asked-for ACK) for an idle
// application, the io thread keeps reading this long rather than sleep: a
// wake-up costs more than the peer's next request takes to come.
inline constexpr auto kAnswerSpin = std::chrono::microseconds(50);
inline constexpr uint32_t kAnswerSpinAfterPackets = 1;
inline constexpr auto kAnswerSpinPerLook = std::chrono::milliseconds(1);
// ...and only while every runnable thread has a CPU, checked at its start
// and every this many reads.
inline constexpr uint32_t kSpinRoundsPerLoadCheck = 16;

// ---- reading sockets ---------------------------------------------------------------

// Datagrams per recvmmsg when a socket is drained.
inline constexpr size_t kReceiveBatch = 16;
// A GRO batch of datagrams (or one datagram of path MTU 4096 plus headers).
inline constexpr size_t kMaxDatagram = 65536;
// READ responses one pass sends before it looks at the sockets again.
inline constexpr uint32_t kReadBudgetPerPass = 64;
// Calls without a break that make an application a busy poller.
inline constexpr uint64_t kBusyPollCalls = 8;
// A polling application reads the socket that last had data and asks the
// epoll set only every this many passes...
inline constexpr uint32_t kLookAroundEvery = 8;
// ...or on every pass for this many after a look found another socket busy
// (several QPs of the process at work).
inline constexpr uint32_t kSeveralFlowsPasses = 4096;
// A socket read this many times in a row by a polling application leaves
// the epoll set (an epoll callback costs every packet sent to it); fewer
// moves would cost an epoll_ctl each.
inline constexpr uint32_t kBusyReadsBeforeLeavingSet = 1024;
// Reads of a connected socket that ask for the GRO segment size after one
// took a search (coalesced_read.h): a flow that needed it once tends to again.
inline constexpr uint32_t kReadsWithGroSizeAfterSearch = 1024;

// ---- sending ---------------------------------------------------------------------

// Socket buffers: a window (kWindowBytes, or kMaxWindow packets), with room.
inline constexpr int kSocketBuffer = 8 << 20;
// GSO sends of one size in a row that set that size on the socket (a plain
// send() is cheaper than a sendmsg with the size), and single datagrams in
// a row that clear it (a single datagram with a size set takes the GSO path).
inline constexpr uint8_t kGsoSendsBeforeSocketSize = 8;
inline constexpr uint8_t kSinglesBeforeSocketSizeGoes = 8;
// UDP GSO limits: the datagrams of one send fit one 64 KiB IP packet, and
// are at most UDP_MAX_SEGMENTS: 128 on newer kernels, 64 on older ones (a
// send of more fails with EINVAL, and the engine falls back to 64). A burst
// of small WRITEs leaves in half as many sends at 128.
inline constexpr size_t kMaxGsoBytes = 60000;
inline constexpr uint8_t kMaxGsoSegments = 128;
inline constexpr uint8_t kMaxGsoSegmentsEverywhere = 64;
// A batch's first datagram may be this long (path MTU 4096 and every header).
inline constexpr size_t kMaxDatagramForBatch = 4096 + 128;
// Payloads up to this are assembled whole and checksummed in one pass; a
// longer one is copied by its CRC pass.
inline constexpr size_t kAssembledPayloadUpTo = 256;

// ---- faults ---------------------------------------------------------------------

// How long a packet picked for reordering waits for its QP's next one.
inline constexpr auto kReorderHold = std::chrono::milliseconds(1);

}  // namespace softverbs::udp::parameters
