#!/usr/bin/perl
# `pvesm export`/`pvesm import` as offline migration and storage_migrate use them: a
# disk (and a snapshot of it) leaves one node's pool as a `raw+size` stream and
# arrives in another node's pool whole, under its name or, when asked, another; a
# stream cut short is refused and leaves no disk behind.

use strict;
use warnings;

use File::Temp qw(tempdir);
use Test::More;

use FewerbytesTest;
use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';
my $MIB = 1024 * 1024;
my $work = tempdir('fb-pve-export-XXXXXX', TMPDIR => 1, CLEANUP => 1);

sub uri { return scalar($plugin->path($_[0], $_[1], STOREID, $_[2])) }

# The source node: a disk of 16 MiB of random data and 4 MiB of zeros past it, then a
# snapshot, then new data over its first MiB.
my $scfg = start_server();
$plugin->activate_storage(STOREID, $scfg, {});
my $disk = $plugin->alloc_image(STOREID, $scfg, 100, 'raw', undef, 20 * 1024);
run_ok('sh', '-c', "head -c 16M /dev/urandom > $work/at-snapshot.raw"
    . " && truncate -s 20M $work/at-snapshot.raw");
run_ok('qemu-img', 'convert', '-n', '-f', 'raw', '-O', 'raw', "$work/at-snapshot.raw",
    uri($scfg, $disk));
$plugin->volume_snapshot($scfg, STOREID, $disk, 'before');
run_ok('qemu-io', '-f', 'raw', '-c', 'write -P 0x5a 0 1M', uri($scfg, $disk));
run_ok('qemu-img', 'convert', '-f', 'raw', '-O', 'raw', uri($scfg, $disk), "$work/now.raw");

is_deeply([$plugin->volume_export_formats($scfg, STOREID, $disk, undef, undef, 0)],
    ['fewerbytes', 'raw+size'], 'a disk exports as send streams first, and as raw+size');
is_deeply([$plugin->volume_export_formats($scfg, STOREID, $disk, undef, undef, 1)],
    ['fewerbytes'], 'with its snapshots, as send streams only');
is_deeply([$plugin->volume_export_formats($scfg, STOREID, $disk, 'now', 'before', 0)],
    ['fewerbytes'], 'and so as an increment from a base');
is_deeply([$plugin->volume_import_formats($scfg, STOREID, $disk, undef, undef, 0)],
    ['fewerbytes', 'raw+size'], 'and imports the same');

sub export_to {
    my ($file, $snapshot) = @_;
    open(my $fh, '>', $file) or die "open $file: $!";
    $plugin->volume_export($scfg, STOREID, $fh, $disk, 'raw+size', $snapshot, undef, 0);
    close($fh) or die "close $file: $!";
}
export_to("$work/disk.stream");
export_to("$work/snapshot.stream", 'before');
for my $stream ("$work/disk.stream", "$work/snapshot.stream") {
    is(-s $stream, 8 + 20 * $MIB, "$stream: the header, then every byte of the disk");
    open(my $fh, '<', $stream) or die "open: $!";
    read($fh, my $header, 8);
    is(unpack('Q<', $header), 20 * $MIB, "$stream: the header holds the disk's size");
}
eval {
    open(my $fh, '>', "$work/refused.stream") or die;
    $plugin->volume_export($scfg, STOREID, $fh, $disk, 'qcow2+size', undef, undef, 1);
};
like($@, qr/fewerbytes, or raw\+size without snapshots/,
    'another format is refused, naming those offered');
stop_server();

# The target node: another pool. The disk arrives under its own name.
$scfg = start_server();
$plugin->activate_storage(STOREID, $scfg, {});

sub import_from {
    my ($file, $volname, $allow_rename) = @_;
    open(my $fh, '<', $file) or die "open $file: $!";
    return $plugin->volume_import($scfg, STOREID, $fh, $volname, 'raw+size', undef, undef,
        0, $allow_rename);
}
is(import_from("$work/disk.stream", $disk, 0), 'fb:vm-100-disk-0',
    'the disk arrives under its name');
like(run_ok('qemu-img', 'compare', '-f', 'raw', '-F', 'raw', "$work/now.raw",
        uri($scfg, 'vm-100-disk-0')),
    qr/Images are identical/, 'holding every byte it held on the source');
is(cli_json('volume', 'info', 'vm-100-disk-0')->{size_bytes}, 20 * $MIB, 'at its size');
is(cli_json('volume', 'info', 'vm-100-disk-0')->{logical_used_bytes}, 16 * $MIB,
    'its zeros stored as nothing');

eval { import_from("$work/snapshot.stream", $disk, 0) };
like($@, qr/'fb:vm-100-disk-0' already exists/, 'a name taken is refused');
is(import_from("$work/snapshot.stream", $disk, 1), 'fb:vm-100-disk-1',
    'or, when renaming is allowed, the next free name');
like(run_ok('qemu-img', 'compare', '-f', 'raw', '-F', 'raw', "$work/at-snapshot.raw",
        uri($scfg, 'vm-100-disk-1')),
    qr/Images are identical/, 'the snapshot exported holds the disk as it was');

# A stream cut short (a migration whose connection dropped) is refused, and the disk
# it began is removed.
run_ok('sh', '-c', "head -c 5M $work/disk.stream > $work/short.stream");
eval { import_from("$work/short.stream", 'vm-200-disk-0', 0) };
like($@, qr/the stream ended after \d+ of 20971520 bytes/, 'a short stream is refused');
ok(!grep({ $_->{name} eq 'vm-200-disk-0' } cli_json('volume', 'list')->@*),
    'and leaves no disk behind');
run_ok('sh', '-c', "head -c 5 $work/disk.stream > $work/no-header.stream");
eval { import_from("$work/no-header.stream", 'vm-200-disk-0', 0) };
like($@, qr/no size found/, 'a stream without its header is refused');
stop_server();

done_testing();
